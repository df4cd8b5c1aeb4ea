"""What a session holds, into the block store: only blocks the store lacks are encoded, and each new
block records the fingerprint parts of its chain and the software and device that computed it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvsnap import provenance, sealing
from kvsnap.engine.contents import Contents
from kvsnap.errors import StoreError
from kvsnap.store import BlockStore, ChainInfo
from kvsnap.types import EncodedBlock


def chain_of(contents: Contents) -> ChainInfo:
    lm, fmt = contents.lm, contents.fmt
    parts = tuple(sorted(lm.fingerprint_parts.items()))
    return ChainInfo(fmt.root(), lm.name, lm.fingerprint, lm.layout, fmt.block_size, parts)


def blocks_for_store(store: BlockStore, contents: Contents, tokens: Sequence[int]) -> list[EncodedBlock | None]:
    """Blocks of ``tokens`` for the store: None for those it holds already, the rest encoded."""
    fmt = contents.fmt
    known = len(store.lookup(tokens, fmt.root(), fmt.block_size, touch=False).hashes)
    return [None] * known + contents.encode(list(tokens), first=known)[0]


def store_blocks(store: BlockStore, contents: Contents) -> int:
    """See ``Session.store_blocks``."""
    _refuse_clear(store, contents)
    bs = contents.fmt.block_size
    tokens = contents.tokens[: len(contents.tokens) // bs * bs]
    if not tokens:
        return 0
    blocks = blocks_for_store(store, contents, tokens)
    return store.put(chain_of(contents), tokens, blocks, **_settings(contents)).new_blocks


def store_session(store: BlockStore, contents: Contents, name: str) -> int:
    """See ``Session.store_session`` (the caller runs the pending tokens first)."""
    _refuse_clear(store, contents)
    if not contents.tokens:
        return 0
    blocks = blocks_for_store(store, contents, contents.tokens)
    kw: dict[str, Any] = dict(messages=contents.messages, last_logits=contents.logits_array(), extra=contents.extra())
    kw.update(_settings(contents))
    return store.add_session(name, chain_of(contents), contents.tokens, blocks, **kw).new_blocks


def _refuse_clear(store: BlockStore, contents: Contents) -> None:
    """Content that is sealed (--encrypt, or read from an encrypted snapshot) stays out of a plain store."""
    sealing.refuse_clear_copy(contents.key, store.key, "what this session holds", StoreError)


def _settings(contents: Contents) -> dict[str, Any]:
    return dict(codec=contents.fmt.codec, level=contents.fmt.level, made_by=provenance.encode(contents.made_by))
