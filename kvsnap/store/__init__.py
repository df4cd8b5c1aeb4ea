"""The block store: KV blocks shared by many sessions, on disk, deduplicated, under a budget. No torch.

index        the bookkeeping in memory (tree, LRU clock, pins, sessions); no files
folder       what makes a folder a store (its marker), and which names in it are kvsnap's
files        where each file lives, checked whole-file reads and writes, the lock
reading      reads that never follow a link, block on a FIFO or read more than expected
blockfile    the trailer that makes each block file self-describing
txn          one transaction's state; adding a chain's blocks
store        ``BlockStore``: one transaction per call over the files and the index
upkeep       check, gc and repair (rebuilding a lost index from the block files)
interchange  sessions to and from ``.kv`` files
closest      the stored prefix nearest a prompt, in every chain (explaining a miss)
"""

from kvsnap.errors import StoreError
from kvsnap.store.index import BlockIndex
from kvsnap.store.records import (
    BlockRecord,
    ChainInfo,
    GcReport,
    PutResult,
    RepairReport,
    SessionRecord,
    StoredBlock,
    StoreMatch,
    block_keys,
)
from kvsnap.store.store import BlockStore

__all__ = [
    "BlockIndex",
    "BlockRecord",
    "BlockStore",
    "ChainInfo",
    "GcReport",
    "PutResult",
    "RepairReport",
    "SessionRecord",
    "StoreError",
    "StoreMatch",
    "StoredBlock",
    "block_keys",
]
