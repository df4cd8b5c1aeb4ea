"""The ``.kv`` snapshot file, and nothing else: no torch, no model.

codec   raw KV bytes <-> stored bytes (shuffle-zstd, zstd, raw, int8-zstd)
meta    the metadata JSON: build it from a ``SnapshotHeader``, parse and bound-check it
writer  encode blocks, lay out the safetensors bytes, write atomically
reader  ``Snapshot``: open and check, read only the blocks asked for, in parallel
atomic       whole-or-nothing writes and the one advisory lock
pool         the decode threads and their scratch buffers
prefetch     a snapshot read and decoded in a thread while the model loads
save_target  the file a chat autosaves to, and whether someone else changed it since
"""

from kvsnap.format.meta import FORMAT_VERSION, READABLE_VERSIONS, BlockInfo, SnapshotHeader, SnapshotMeta
from kvsnap.format.reader import Snapshot
from kvsnap.format.writer import block_name, encode_block, write_snapshot

__all__ = [
    "FORMAT_VERSION",
    "READABLE_VERSIONS",
    "BlockInfo",
    "Snapshot",
    "SnapshotHeader",
    "SnapshotMeta",
    "block_name",
    "encode_block",
    "write_snapshot",
]
