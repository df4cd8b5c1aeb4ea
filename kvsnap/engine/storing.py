"""A session's blocks into the block store: only blocks the store lacks are encoded, and each new block
records the fingerprint parts of its chain and the software and device that computed it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvsnap import provenance
from kvsnap.engine.saving import encode_blocks
from kvsnap.engine.verify import recorded
from kvsnap.types import EncodedBlock

if TYPE_CHECKING:
    from kvsnap.engine.session import Session
    from kvsnap.store import ChainInfo


def chain_of(session: Session) -> ChainInfo:
    from kvsnap.store import ChainInfo

    lm = session.lm
    parts = tuple(sorted(lm.fingerprint_parts.items()))
    return ChainInfo(session.root(), lm.name, lm.fingerprint, lm.layout, session.block_size, parts)


def blocks_for_store(session: Session, tokens: Sequence[int]) -> list[EncodedBlock | None]:
    """Blocks of ``tokens`` for the store: None for those it holds already, the rest encoded."""
    assert session.store is not None
    known = len(session.store.lookup(tokens, session.root(), session.block_size, touch=False).hashes)
    return [None] * known + encode_blocks(session, tokens, first=known)[0]


def store_blocks(session: Session) -> int:
    """See ``Session.store_blocks``."""
    bs = session.block_size
    tokens = session.tokens[: len(session.tokens) // bs * bs]
    if not tokens:
        return 0
    blocks = blocks_for_store(session, tokens)
    return session.store.put(chain_of(session), tokens, blocks, **_settings(session)).new_blocks


def store_session(session: Session, name: str) -> int:
    """See ``Session.store_session``."""
    session.flush()
    if not session.tokens:
        return 0
    blocks = blocks_for_store(session, session.tokens)
    logits = session.last_logits.float().cpu().numpy() if session.last_logits is not None else None
    kw: dict[str, Any] = dict(messages=session.messages, last_logits=logits, **_settings(session))
    return session.store.add_session(name, chain_of(session), session.tokens, blocks, **kw).new_blocks


def _settings(session: Session) -> dict[str, Any]:
    made_by = provenance.encode(recorded(session).get("made_by"))
    return dict(codec=session.codec, level=session.level, made_by=made_by)
