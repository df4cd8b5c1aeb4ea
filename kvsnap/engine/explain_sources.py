"""Explaining a miss against its source: a ``.kv`` file (its header and tokens only), the block store
(its closest stored prefix, in every chain) or what a session held before the request. The causes
and the ``Miss`` value are ``kvsnap.engine.explain``'s."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvsnap import hashing, prefix
from kvsnap.engine.explain import Decode, Messages, Miss, Running, chain_mismatch, explain

if TYPE_CHECKING:
    from kvsnap.store.closest import Closest


def against_snapshot(
    path: str | Path,
    prompt_ids: Sequence[int],
    decode: Decode,
    running: Running | None = None,
    *,
    reused: int | None = None,
    prompt_messages: Messages | None = None,
) -> Miss:
    """The prompt against a ``.kv`` file (its header and tokens only; no KV is read)."""
    from kvsnap.format.reader import Snapshot

    with Snapshot(path) as snap:
        meta, tokens = snap.meta, snap.tokens
    mismatch = chain_mismatch(
        running,
        model=meta.model,
        fingerprint=meta.fingerprint,
        parts=meta.fingerprint_parts,
        kv_dtype=meta.layout.dtype,
        root=meta.root,
        block_size=meta.block_size,
        check_block_size=False,  # a run reads a file in the file's own block size
    )
    if reused is None:
        hit = prefix.match_prefix(prompt_ids, tokens, meta.block_hashes, meta.block_size, meta.root).hit_tokens
        reused = 0 if mismatch else hit
    return explain(
        prompt_ids,
        tokens,
        decode,
        block_size=meta.block_size,
        reused=reused,
        prompt_messages=prompt_messages,
        source_messages=meta.messages,
        mismatch=mismatch,
    )


def closest_stored(index: Any, prompt_ids: Sequence[int], running: Running | None = None) -> Closest | None:
    """``store.closest.closest_in_store``, preferring on a tie the chain ``running`` keys its KV under."""
    from kvsnap.store.closest import closest_in_store

    def runs_under(chain: Any) -> bool:
        if running is None:
            return False
        fp = running.fingerprint(chain.layout.dtype, dict(chain.parts).get("quantization", "none"))
        return hashing.chain_root(fp, running.namespace, running.block_size) == chain.root

    return closest_in_store(index, prompt_ids, runs_under)


def against_store(
    index: Any, prompt_ids: Sequence[int], decode: Decode, running: Running | None = None, found: Closest | None = None
) -> Miss | None:
    """The prompt against the closest stored prefix (``found``, else ``closest_stored``'s; None for an empty
    store). A run reuses whole blocks only: up to the last one before where the prompt and the stored tokens part."""
    found = found or closest_stored(index, prompt_ids, running)
    if found is None:
        return None
    chain = index.chains[found.root]
    mismatch = chain_mismatch(
        running,
        model=chain.model,
        fingerprint=chain.fingerprint,
        parts=dict(chain.parts),
        kv_dtype=chain.layout.dtype,
        root=chain.root,
        block_size=chain.block_size,
        check_block_size=True,
    )
    where = f"{chain.model}, block size {chain.block_size}, {chain.layout.dtype}"
    reused = 0 if mismatch else found.matched_blocks * chain.block_size
    miss = explain(
        prompt_ids, found.tokens, decode, block_size=chain.block_size, reused=reused, source="store",
        mismatch=mismatch, where=where,
    )  # fmt: skip
    return miss


def for_session(
    session: Any,
    prompt_ids: Sequence[int],
    reused: int,
    *,
    resume: str | Path | None,
    held: tuple[Sequence[int], Messages | None],
    prompt_messages: Messages | None,
) -> Miss | None:
    """What a ``Session.run`` missed: against its ``resume`` file, else what the session held before,
    else the block store; None when there was nothing to reuse from (or it cannot be read). Tokens that
    matched but were recomputed by the load-or-recompute decision are cause ``reuse``."""
    lm = session.lm
    running = Running(dict(lm.fingerprint_parts), session.namespace, session.block_size, lm.name)
    decode = lm.tokenizer.decode
    miss = _for_session(session, prompt_ids, reused, resume, held, prompt_messages, running, decode)
    decided = session.last_reuse
    if miss is not None and decided is not None and decided.decision == "recompute":
        from dataclasses import replace

        why = f"{miss.why}; the matching tokens were recomputed, not loaded ({decided.reason})"
        return replace(miss, cause="reuse" if miss.cause == "none" else miss.cause, why=why)
    return miss


def _for_session(
    session: Any,
    prompt_ids: Sequence[int],
    reused: int,
    resume: str | Path | None,
    held: tuple[Sequence[int], Messages | None],
    prompt_messages: Messages | None,
    running: Running,
    decode: Decode,
) -> Miss | None:
    from kvsnap.errors import KvsnapError

    try:
        if resume is not None and Path(resume).exists():
            return against_snapshot(resume, prompt_ids, decode, running, reused=reused, prompt_messages=prompt_messages)
        if held[0]:
            return explain(
                prompt_ids, held[0], decode, block_size=session.block_size, reused=reused, source="session",
                prompt_messages=prompt_messages, source_messages=held[1],
            )  # fmt: skip
        if session.store is not None:
            miss = against_store(session.store.read_index(), prompt_ids, decode, running)
            return None if miss is None else _with_reused(miss, reused)
    except KvsnapError:
        return None  # the run said what failed (restore_error, store_error); there is nothing to explain
    return None


def _with_reused(miss: Miss, reused: int) -> Miss:
    from dataclasses import replace

    return replace(miss, reused_tokens=reused)
