"""The block store: KV blocks shared by many sessions, on disk, deduplicated, under a budget. No torch.

index        the bookkeeping in memory (tree, LRU clock, pins, sessions); no files
files        where each file lives, checked whole-file reads and writes, the lock
store        ``BlockStore``: one transaction per call over the files and the index
interchange  sessions to and from ``.kv`` files
"""

from kvsnap.errors import StoreError
from kvsnap.store.index import BlockIndex
from kvsnap.store.records import (
    BlockRecord,
    ChainInfo,
    GcReport,
    PutResult,
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
    "SessionRecord",
    "StoreError",
    "StoreMatch",
    "StoredBlock",
    "block_keys",
]
