"""What a block file says about itself: its stored bytes, then a trailer naming the block. No files, no torch.

    <stored bytes> <trailer: JSON> <trailer length: u32 little-endian> <MAGIC: 8 bytes>

The trailer holds the block's index entry (hash, parent, chain root, token ids, full, raw and
stored sizes, checksum, codec, level, the software that made it) and its chain (model,
fingerprint, layout, block size), so ``BlockStore.repair`` can rebuild the entry from the file
alone when the index is lost, and prove it: the hash must be the chained hash of the parent and
the token ids, the stored bytes must pass the checksum and decode to the size the layout gives
those tokens. It goes after the stored bytes
so the file still starts with what a ``.kv`` snapshot holds for the block. Files written before
trailers existed hold the stored bytes alone: still read (their index entry vouches for them), but
they prove nothing on their own.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from kvsnap import hashing, provenance
from kvsnap.errors import StoreError
from kvsnap.store.records import BlockRecord, ChainInfo, StoredBlock, record_problem
from kvsnap.types import KVLayout

MAGIC = b"\x00kvsblk1"
_LENGTH = struct.Struct("<I")
TAIL = _LENGTH.size + len(MAGIC)  # the fixed end of every trailer
# Token ids of one block and a chain's names fit in far less; a bigger "trailer" is damage, never read.
TRAILER_LIMIT = 1 << 20


def trailer(record: BlockRecord, chain: ChainInfo) -> bytes:
    body = json.dumps(
        {
            "hash": record.hash.hex(),
            "parent": record.parent.hex(),
            "root": record.root.hex(),
            "tokens": list(record.token_ids),
            "full": record.full,
            "raw_bytes": record.raw_bytes,
            "stored_bytes": record.stored_bytes,
            "checksum": record.checksum,
            "codec": record.codec,
            "level": record.level,
            **({"made_by": record.made_by} if record.made_by else {}),
            "chain": {
                "model": chain.model,
                "fingerprint": chain.fingerprint,
                "layout": chain.layout.to_json(),
                "block_size": chain.block_size,
            },
        },
        separators=(",", ":"),
        ensure_ascii=True,
    ).encode()
    return body + _LENGTH.pack(len(body)) + MAGIC


def trailer_length(tail: bytes) -> int | None:
    """The JSON length a file's last ``TAIL`` bytes announce; None for a file without a trailer."""
    if len(tail) != TAIL or tail[-len(MAGIC) :] != MAGIC:
        return None
    return _LENGTH.unpack_from(tail)[0]


def parse_trailer(body: bytes) -> tuple[BlockRecord, ChainInfo]:
    """The entry and chain a trailer's JSON names; ``StoreError`` if it is not one kvsnap wrote."""
    try:
        data: Any = json.loads(body)
        c = data["chain"]
        chain = ChainInfo(
            bytes.fromhex(data["root"]),
            str(c["model"]),
            str(c["fingerprint"]),
            KVLayout.from_json(c["layout"]),
            int(c["block_size"]),
        )
        record = BlockRecord(
            hash=bytes.fromhex(data["hash"]),
            parent=bytes.fromhex(data["parent"]),
            root=chain.root,
            token_ids=tuple(int(t) for t in data["tokens"]),
            full=bool(data["full"]),
            raw_bytes=int(data["raw_bytes"]),
            stored_bytes=int(data["stored_bytes"]),
            checksum=str(data["checksum"]),
            codec=str(data["codec"]),
            level=int(data["level"]),
            made_by=provenance.encode(provenance.parse(data.get("made_by"))),
        )
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise StoreError("its trailer is malformed") from None
    return record, chain


def prove(record: BlockRecord, chain: ChainInfo, stored: bytes) -> None:
    """Everything a reader would trip over, checked: ``StoreError`` saying what does not hold."""
    if len(record.hash) != hashing.DIGEST_SIZE or hashing.block_hash(record.parent, record.token_ids) != record.hash:
        raise StoreError("its hash is not the chained hash of its parent and token ids")
    problem = record_problem(record, chain)
    if problem is not None:
        raise StoreError(problem)
    if len(stored) != record.stored_bytes or hashing.checksum(stored) != record.checksum:
        raise StoreError("its stored bytes fail their checksum")
    StoredBlock(record, stored).decode(chain.layout.itemsize)
