"""One block store transaction's state, and adding a chain's blocks inside one. No torch here."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvsnap.errors import ConfigError
from kvsnap.format import codec as codecs
from kvsnap.store import blockfile
from kvsnap.store.files import StoreFiles
from kvsnap.store.index import BlockIndex
from kvsnap.store.records import BlockRecord, ChainInfo, PutResult, block_keys, check_block
from kvsnap.types import EncodedBlock


@dataclass
class Txn:
    """What one call changes: the index it loaded, and the files to fsync and to delete once it is saved."""

    index: BlockIndex
    dirs: set[Path] = dataclasses.field(default_factory=set)  # folders that got new files: fsynced before the index
    doomed: list[Path] = dataclasses.field(default_factory=list)  # deleted once the index no longer names them
    optional: bool = False  # the index changes only record use: a store that cannot be written still answers

    def write(self, files: StoreFiles, path: Path, parts: list[bytes | memoryview]) -> None:
        files.write(path, parts)
        self.dirs.add(path.parent)

    def evict(self, files: StoreFiles) -> list[bytes]:
        """Evict least recently used leaves until the budget holds; their files go once the index is saved."""
        evicted = self.index.evict()
        self.doomed.extend(files.block_path(h) for h in evicted)
        return evicted

    def drop_subtree(self, files: StoreFiles, h: bytes) -> list[bytes]:
        """Drop block ``h`` and every block below it; their files go once the index is saved."""
        dropped = self.index.remove_subtree(h)
        self.doomed.extend(files.block_path(x) for x in dropped)
        return dropped


def put_blocks(
    files: StoreFiles,
    t: Txn,
    chain: ChainInfo,
    token_ids: Sequence[int],
    blocks: Sequence[EncodedBlock | None],
    codec: str,
    level: int,
    with_tail: bool,
    made_by: str = "",
) -> tuple[list[bytes], int, int]:
    """Add a chain's blocks (see ``BlockStore.put``): the hashes stored, from the first, and how many were
    new and how many already stored. Each new block file gets its trailer (``blockfile``); new blocks
    record ``made_by`` (``kvsnap.provenance.encode``), a block already stored keeps its own."""
    if codec in codecs.LOSSY_CODECS:
        raise ConfigError(f"codec {codec!r} is lossy: the block store keeps exact cache-dtype blocks only")
    if codec not in codecs.CODECS:
        raise ConfigError(f"unknown codec {codec!r} (known: {', '.join(codecs.CODECS)})")
    bs = chain.block_size
    keys = block_keys(token_ids, bs, chain.root)
    num_full = len(token_ids) // bs
    if len(blocks) not in (num_full, len(keys)):
        raise ValueError(f"{len(blocks)} blocks given for {len(token_ids)} tokens in blocks of {bs}")
    index = t.index
    index.add_chain(chain)
    stored: list[bytes] = []
    new = reused = 0
    parent = chain.root
    for i, (h, block) in enumerate(zip(keys, blocks)):
        tokens = tuple(int(x) for x in token_ids[i * bs : (i + 1) * bs])
        full = len(tokens) == bs
        if not full and not with_tail:
            break
        known = index.blocks.get(h)
        if block is not None:
            check_block(i, block, h if full else None, len(tokens) * chain.layout.bytes_per_token)
        if known is not None:
            # Dedup; put() refuses a hash stored for other tokens (a collision).
            index.put(dataclasses.replace(known, parent=parent, root=chain.root, token_ids=tokens))
            reused += 1
        elif block is None:
            break  # evicted since the caller looked: keep the blocks before the gap
        else:
            record = BlockRecord(
                h,
                parent,
                chain.root,
                tokens,
                full,
                block.raw_bytes,
                len(block.stored),
                block.checksum,
                codec,
                level,
                made_by,
            )
            trailer = blockfile.trailer(record, index.chains[chain.root])
            t.write(files, files.block_path(h), [block.stored, trailer])
            index.put(record)
            new += 1
        stored.append(h)
        parent = h
    return stored, new, reused


def put_result(index: BlockIndex, hashes: list[bytes], new: int, reused: int, evicted: list[bytes]) -> PutResult:
    kept = []
    for h in hashes:
        if h not in index.blocks:
            break
        kept.append(h)
    tokens = sum(len(index.blocks[h].token_ids) for h in kept)
    return PutResult(tuple(kept), tokens, new, reused, tuple(evicted))
