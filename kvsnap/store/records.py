"""Plain records of the block store: what the index holds and what store calls return. No files, no torch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvsnap import hashing
from kvsnap.errors import StoreError
from kvsnap.format import codec as codecs
from kvsnap.hashing import checksum
from kvsnap.types import EncodedBlock, KVLayout


@dataclass(frozen=True, slots=True)
class ChainInfo:
    """What a chain root stands for: one model, its cache layout and one block size (the namespace is hashed in)."""

    root: bytes
    model: str
    fingerprint: str
    layout: KVLayout
    block_size: int
    # The fingerprint's parts (config, tokenizer, weights, kv_dtype), so an explanation of a miss can
    # say which one differs; () for chains recorded before they were kept.
    parts: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class BlockRecord:
    """One stored block as the index knows it; the block's bytes live in the store's block file."""

    hash: bytes
    parent: bytes  # the previous block's hash, or the chain root for a chain's first block
    root: bytes
    token_ids: tuple[int, ...]
    full: bool  # False for a session's partial tail: kept for export, never matched by a lookup
    raw_bytes: int
    stored_bytes: int
    checksum: str
    codec: str
    level: int
    made_by: str = ""  # kvsnap.provenance.encode of the software and device that computed it; "" unknown


@dataclass(frozen=True, slots=True)
class SessionRecord:
    """A named token sequence over stored blocks. Pinned sessions keep their blocks from eviction."""

    name: str
    root: bytes
    token_ids: tuple[int, ...]
    hashes: tuple[bytes, ...]  # every block of the tokens, the partial tail's (if any) last
    pinned: bool
    messages: tuple[dict[str, str], ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    logits: str | None = None  # blob id of the last position's logits (float32), if kept


@dataclass(frozen=True, slots=True)
class StoreMatch:
    """The longest run of full blocks of a prompt found in the store (hashes, parents and tokens checked)."""

    hit_tokens: int
    block_size: int
    hashes: tuple[bytes, ...]
    # One line per block this fetch could not use (a miss from there on): damaged and dropped, or
    # found on disk but not indexed, and not adoptable.
    dropped: tuple[str, ...] = ()

    @property
    def full_blocks(self) -> int:
        return len(self.hashes)


def tail_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Key of a partial tail block: the chained hash of its fewer-than-``block_size`` tokens.

    Its input is shorter than any full block's, so it never equals a full block's hash.
    """
    return hashing.block_hash(parent, token_ids)


def block_keys(token_ids: Sequence[int], block_size: int, root: bytes) -> list[bytes]:
    """Keys of every block of ``token_ids``: the full blocks' chained hashes, then the partial tail's, if any."""
    keys = hashing.chain_hashes(token_ids, block_size, root)
    done = len(keys) * block_size
    if done < len(token_ids):
        keys.append(tail_hash(keys[-1] if keys else root, token_ids[done:]))
    return keys


@dataclass(frozen=True, slots=True)
class PutResult:
    """What a ``put``, ``add_session`` or ``import_snapshot`` left in the store."""

    hashes: tuple[bytes, ...]  # the chain's blocks stored after the call, from the first
    stored_tokens: int  # tokens those blocks cover
    new_blocks: int  # written by this call
    reused_blocks: int  # already stored (deduplicated)
    evicted: tuple[bytes, ...]  # evicted to fit the budget, in order


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """A block read from the store, checksum verified."""

    record: BlockRecord
    data: bytes  # the stored (encoded) bytes

    def encoded(self) -> EncodedBlock:
        """As a snapshot block (what ``Session`` keeps so its next save does not encode it again)."""
        r = self.record
        return EncodedBlock(len(r.token_ids), r.hash if r.full else None, r.raw_bytes, self.data, r.checksum)

    def decode(self, itemsize: int, out: np.ndarray | None = None) -> bytes | bytearray | np.ndarray:
        """The block's raw KV bytes, ``[layers, 2, kv_heads, tokens, head_dim]`` (see ``codec.decode`` for ``out``)."""
        r = self.record
        try:
            return codecs.decode(self.data, r.raw_bytes, itemsize, r.codec, out)
        except codecs.CodecError as exc:
            raise StoreError(f"block {r.hash.hex()[:12]} does not decode ({exc})") from None
        except MemoryError:
            raise StoreError(f"block {r.hash.hex()[:12]} declares more bytes than fit in memory") from None

    def decode_into(self, itemsize: int, dst: np.ndarray) -> None:
        """Decode straight into ``dst`` (see ``codec.decode_into``)."""
        r = self.record
        try:
            codecs.decode_into(self.data, r.raw_bytes, itemsize, r.codec, dst)
        except codecs.CodecError as exc:
            raise StoreError(f"block {r.hash.hex()[:12]} does not decode ({exc})") from None
        except MemoryError:
            raise StoreError(f"block {r.hash.hex()[:12]} declares more bytes than fit in memory") from None


@dataclass(frozen=True, slots=True)
class GcReport:
    temp_files: int  # left by crashed writers
    orphan_files: int  # block or logits files the index does not name
    dropped_blocks: int  # missing or damaged, with the blocks below them
    dropped_sessions: int  # unpinned sessions none of whose blocks are left
    evicted: int  # to fit the budget
    unknown: tuple[str, ...] = ()  # things in the folder kvsnap did not write: left alone, never deleted


@dataclass(frozen=True, slots=True)
class RepairReport:
    """What ``BlockStore.repair`` found and rebuilt. It deletes nothing: what it cannot prove it reports."""

    index: str  # "sound", "missing", or why it could not be read
    kept_blocks: int  # index entries whose files are sound
    recovered_blocks: int  # block files the index did not name, proven by their trailers and added
    dropped_blocks: int  # index entries whose files are missing or damaged (and those below them)
    unproven: tuple[str, ...]  # block files that prove nothing (old format, damaged, no parent): kept as they are
    unknown: tuple[str, ...]  # things in the folder kvsnap did not write: left alone
    damaged_index: str | None = None  # where the unreadable index was kept


def check_block(i: int, block: EncodedBlock, hash_: bytes | None, raw_bytes: int) -> None:
    """A caller's block must be the block of these tokens: a mismatch is a bug, never stored."""
    if block.hash != hash_:
        raise ValueError(f"block {i}: its hash does not match the token ids")
    if block.raw_bytes != raw_bytes:
        raise ValueError(f"block {i}: {block.raw_bytes} raw bytes, expected {raw_bytes}")
    if checksum(block.stored) != block.checksum:
        raise StoreError(f"block {i}: stored bytes do not match their checksum (changed since encoded?)")


def record_problem(record: BlockRecord, chain: ChainInfo | None) -> str | None:
    """Why an index entry cannot describe a usable block of its chain, or None.

    Cheap (no file is read), so a lookup checks it for every block it uses: an entry edited by hand
    is a miss then, not a failure of every run when the block does not decode.
    """
    if chain is None:
        return "its chain root is unknown"
    n = len(record.token_ids)
    if not 0 < n <= chain.block_size or record.full != (n == chain.block_size):
        return f"{n} token ids recorded in a chain of block size {chain.block_size}"
    if record.raw_bytes != n * chain.layout.bytes_per_token:
        expected = n * chain.layout.bytes_per_token
        return f"{record.raw_bytes} raw bytes recorded, but {n} tokens of this cache hold {expected}"
    if record.codec not in codecs.CODECS:
        return f"codec {record.codec!r} is not a lossless codec the store keeps"
    return None
