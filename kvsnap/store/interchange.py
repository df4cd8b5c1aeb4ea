"""Moving sessions between the block store and ``.kv`` files, both ways, without re-encoding
blocks that already have the file's codec. No torch here."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvsnap import provenance, sealing
from kvsnap.errors import StoreError
from kvsnap.format import codec as codecs
from kvsnap.format.meta import SnapshotHeader
from kvsnap.format.reader import Snapshot
from kvsnap.format.writer import encode_block, write_snapshot
from kvsnap.sealing import SealKey
from kvsnap.store.records import ChainInfo, PutResult
from kvsnap.store.store import BlockStore
from kvsnap.types import EncodedBlock, Messages


@dataclass(frozen=True, slots=True)
class SessionExport:
    """A stored session as a ``.kv`` file would hold it."""

    header: SnapshotHeader
    tokens: tuple[int, ...]
    blocks: tuple[EncodedBlock, ...]
    last_logits: np.ndarray | None
    messages: Messages | None
    key: SealKey | None = None  # an encrypted store's: the file is sealed with it (kvsnap.sealing.save_key)

    @property
    def codec(self) -> str:
        return self.header.codec

    def write(self, path: str | os.PathLike[str]) -> int:
        """Write the ``.kv`` file atomically (sealed when the store is encrypted); returns its size."""
        key = sealing.save_key(None, self.key)
        logits, messages = self.last_logits, self.messages
        return write_snapshot(
            path, self.header, self.tokens, self.blocks, last_logits=logits, messages=messages, key=key
        )


def session_export(store: BlockStore, name: str) -> SessionExport:
    """Session ``name`` ready to write; ``StoreError`` if a block is gone or damaged.

    Blocks stored with another codec than the session's first block are re-encoded to it (a
    ``.kv`` file names one codec).
    """
    chain, session, stored, logits = store.read_session(name)
    codec, level = stored[0].record.codec, stored[0].record.level
    itemsize = chain.layout.itemsize
    blocks = []
    for block in stored:
        r = block.record
        if r.codec != codec:
            raw = block.decode(itemsize)
            blocks.append(encode_block(raw, len(r.token_ids), r.hash if r.full else None, itemsize, codec, level))
        else:
            blocks.append(block.encoded())
    extra = dict(session.extra)
    # The file names one provenance for all its blocks: the blocks' own when they agree, else none
    # (unknown, so a resume spot checks it).
    makers = {b.record.made_by for b in stored}
    extra.pop("made_by", None)
    if len(makers) == 1 and "" not in makers:
        extra["made_by"] = provenance.parse(makers.pop())
    header = SnapshotHeader(
        model=chain.model,
        fingerprint=chain.fingerprint,
        root=chain.root,
        layout=chain.layout,
        block_size=chain.block_size,
        codec=codec,
        level=level,
        fingerprint_parts=dict(chain.parts),
        extra=extra,
    )
    return SessionExport(
        header=header,
        tokens=session.token_ids,
        blocks=tuple(blocks),
        last_logits=np.frombuffer(logits, dtype="<f4").copy() if logits is not None else None,
        messages=session.messages,
        key=store.key,
    )


def refuse_inexact(path: str | os.PathLike[str], codec: str, cache_dtype: str, storage_dtype: str) -> None:
    """The store keeps exact cache-dtype blocks only: it shares them with every later run of the same
    prefix, so a block narrowed or quantised once would make other sessions' answers drift too."""
    why = None
    if storage_dtype != cache_dtype:
        why = f"its blocks are stored as {storage_dtype} (--kv-dtype), not the cache's {cache_dtype}"
    elif codec in codecs.LOSSY_CODECS:
        why = f"its blocks use the lossy codec {codec}"
    if why is not None:
        raise StoreError(
            f"{path}: {why}; the block store keeps exact cache-dtype blocks only (resume the file with --resume)"
        )


def export_session(store: BlockStore, name: str, path: str | os.PathLike[str]) -> int:
    """Write store session ``name`` as a ``.kv`` snapshot (atomically); returns the file size."""
    return session_export(store, name).write(path)


def import_snapshot(
    store: BlockStore, path: str | os.PathLike[str], name: str | None = None, *, pin: bool | None = None
) -> PutResult:
    """Add a ``.kv`` file's blocks (verified, not re-encoded) and record it as session ``name``
    (default: the file name without ``.kv``), with its chat messages and last-position logits. An
    encrypted snapshot goes into an encrypted store only."""
    with Snapshot(path) as snap:
        sealing.refuse_clear_copy(snap.key, store.key, str(path), StoreError)
        meta = snap.meta
        refuse_inexact(path, meta.codec, meta.layout.dtype, meta.storage_layout.dtype)
        # Copies: the snapshot's map closes with the file.
        blocks = [snap.encoded_block(i, bytes(snap.read_stored(i))) for i in range(len(meta.blocks))]
        logits = snap.last_logits()
        tokens = list(snap.tokens)
    parts = tuple(sorted(meta.fingerprint_parts.items()))
    chain = ChainInfo(meta.root, meta.model, meta.fingerprint, meta.layout, meta.block_size, parts)
    return store.add_session(
        name if name is not None else Path(path).stem,
        chain,
        tokens,
        blocks,
        codec=meta.codec,
        level=meta.level,
        pin=pin,
        messages=meta.messages,
        last_logits=logits,
        extra=meta.extra,
        made_by=provenance.encode(provenance.parse(meta.extra.get("made_by"))),
    )
