"""The blocks a session has already encoded, so a save writes them again without compressing them.

Full blocks are keyed by their chained hash; the partial tail of the last save by the hash of its
tokens under its parent (it has no chained hash), so an autosave followed by ``/save`` encodes
nothing twice. Keys past a truncation are dropped: their KV is recomputed and may differ in bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from kvsnap import hashing
from kvsnap.format.writer import encode_block
from kvsnap.types import KV_DTYPES, BlockFormat, EncodedBlock

if TYPE_CHECKING:
    from kvsnap.engine.cache import KVCache

_ENCODE_WORKERS = 4


class EncodedBlocks:
    """Encodings of full blocks by chained hash, and of the last partial tail by its key."""

    def __init__(self, by_hash: dict[bytes, EncodedBlock] | None = None):
        self.by_hash: dict[bytes, EncodedBlock] = dict(by_hash or {})
        self._tail: tuple[bytes, EncodedBlock] | None = None

    def keep_only(self, hashes: set[bytes], *, keep_tail: bool = False) -> None:
        """Forget every full block not in ``hashes`` (and the tail, unless ``keep_tail``)."""
        self.by_hash = {h: b for h, b in self.by_hash.items() if h in hashes}
        if not keep_tail:
            self._tail = None

    def encode(
        self, cache: KVCache, tokens: Sequence[int], fmt: BlockFormat, first: int = 0
    ) -> tuple[list[EncodedBlock], int]:
        """Blocks ``first``.. of ``tokens`` (whose KV is in the cache) as ``fmt`` stores them, and how many
        had to be encoded: blocks compressed earlier in the session (or read from a snapshot) are reused
        as they are, the rest are encoded in parallel threads."""
        bs, root, storage_dtype = fmt.block_size, fmt.root(), fmt.storage_dtype
        n = len(tokens)
        hashes = hashing.chain_hashes(tokens, bs, root)
        blocks: list[EncodedBlock | None] = []
        todo: list[tuple[int, int, int, bytes | None]] = []
        for i in range(first, -(-n // bs)):
            start, end = i * bs, min((i + 1) * bs, n)
            h = hashes[i] if i < len(hashes) else None
            if h is not None:
                cached = self.by_hash.get(h)
            else:
                # A partial tail has no chained hash; its key is the hash of its tokens under its parent,
                # so a save right after another (an autosave, then /save) does not encode it again.
                tail_key = hashing.block_hash(hashes[i - 1] if i else root, tokens[start:end])
                cached = self._tail[1] if self._tail is not None and self._tail[0] == tail_key else None
            if cached is not None and cached.origin is not None and not cached.still_valid():
                cached = None  # a view of a file someone changed in place since it was read: encode afresh
            blocks.append(cached)
            if cached is None:
                todo.append((i - first, start, end, h))
        itemsize = KV_DTYPES[storage_dtype]

        def encode(job: tuple[int, int, int, bytes | None]) -> EncodedBlock:
            _, start, end, h = job
            raw = cache.block_raw(start, end, storage_dtype)
            return encode_block(raw, end - start, h, itemsize, fmt.codec, fmt.level, storage_dtype)

        with ThreadPoolExecutor(max_workers=_ENCODE_WORKERS) as pool:
            for (i, start, end, _), block in zip(todo, pool.map(encode, todo)):
                blocks[i] = block
                if block.hash is not None:
                    self.by_hash[block.hash] = block
                else:
                    parent = hashes[start // bs - 1] if start else root
                    self._tail = (hashing.block_hash(parent, tokens[start:end]), block)
        final = [b for b in blocks if b is not None]
        assert len(final) == len(blocks)
        return final, len(todo)
