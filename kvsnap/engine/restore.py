"""Restoring a prefix's KV without running the model: from a ``.kv`` file or from the block store.

Each function reads and checks everything first and returns a ``Restored`` state; the session
commits it whole, so a failure leaves the session as it was.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvsnap import conversation, prefix, provenance
from kvsnap.engine import arena
from kvsnap.engine.cache import KVCache, cache_for, cache_from_buffer
from kvsnap.engine.kv_transfer import KVTransfer
from kvsnap.engine.results import RestoreStats
from kvsnap.format import prefetch
from kvsnap.format.pool import Scratch, map_in_order
from kvsnap.format.reader import Snapshot
from kvsnap.models.architecture import TORCH_DTYPES
from kvsnap.models.load import LoadedModel
from kvsnap.types import DROPPED_MESSAGES, BlockFormat, EncodedBlock, dropped_messages

if TYPE_CHECKING:
    from kvsnap.sealing import SealKey
    from kvsnap.store import BlockStore

# Room past the prompt for a first answer, so it is written in place.
DECODE_ROOM = 256

LoadOk = Callable[[int, int], bool]  # (hit_tokens, stored_bytes) -> load it (True) or recompute it


@dataclass(frozen=True, slots=True)
class Restored:
    """A session's state after a restore, ready to commit."""

    cache: KVCache
    tokens: list[int]
    last_logits: np.ndarray | None  # after tokens[-1], when the source kept them
    encoded: dict[bytes, EncodedBlock]  # blocks already encoded as the session would save them
    messages: list[dict[str, str]] | None
    stats: RestoreStats
    dropped_messages: int = 0  # of ``messages``, out of the model's view (kvsnap.types.chat_view)
    pending: list[int] = field(default_factory=list)  # an answer's sampled ids not run yet (kvsnap.conversation)
    turn_ends: conversation.TurnEnds = field(default_factory=list)
    sealed_with: SealKey | None = None  # the key of the encrypted snapshot it was read from


def _marks(lm: LoadedModel, extra: dict[str, Any], messages: list[dict[str, str]] | None, tokens: list[int]) -> dict:
    """The chat's pending ids and turn ends, for a whole restore with messages (else none). Pending ids
    the model has no embedding for are a file that does not fit: both are ignored."""
    if messages is None or not tokens:
        return {}
    turn_ends, pending = conversation.read(extra, len(messages), len(tokens))
    vocab = int(getattr(lm.config, "vocab_size", 0) or len(lm.tokenizer))
    if any(t >= vocab for t in pending):
        return {}
    return {"pending": pending, "turn_ends": turn_ends}


def from_snapshot(
    lm: LoadedModel,
    path: str | Path,
    fmt: BlockFormat,
    prompt_ids: Sequence[int] | None,
    *,
    load_ok: LoadOk | None = None,
    key: SealKey | None = None,
) -> Restored:
    """The longest prefix of ``prompt_ids`` a snapshot holds (all of it, with its chat messages, when
    ``prompt_ids`` is None). Only the matched blocks are read. The snapshot's chain must be ``fmt``'s
    (at the snapshot's own block size); one under another root, model or layout is refused.

    ``load_ok(hit_tokens, stored_bytes)`` may decide that recomputing the prefix is faster than
    loading it: then no block is read and nothing is restored (a chat keeps its messages). ``key``
    opens an encrypted snapshot (default: ``$KVSNAP_KEY_FILE``'s).
    """
    t0 = time.perf_counter()
    # Decoded in the background while the model loaded (kvsnap.format.prefetch), when the CLI asked:
    # the same checks follow, and only the cache is built differently.
    pre = prefetch.claim(path)
    if pre is not None and lm.device.type != "cpu":
        pre.snapshot.close()
        pre = None
    with pre.snapshot if pre is not None else Snapshot(path, key) as snap:
        meta = snap.meta
        root = fmt.root(meta.block_size)
        snap.check_compatible(
            model=lm.name,
            fingerprint=lm.fingerprint,
            root=root,
            layout=lm.layout,
            fingerprint_parts=lm.fingerprint_parts,
        )
        if prompt_ids is None:
            hit = meta.num_tokens
        else:
            hit = prefix.match_prefix(prompt_ids, snap.tokens, meta.block_hashes, meta.block_size, root).hit_tokens
        num_blocks = -(-hit // meta.block_size)
        if hit and load_ok is not None and not load_ok(hit, sum(b.stored_bytes for b in meta.blocks[:num_blocks])):
            messages = list(meta.messages) if (prompt_ids is None and meta.messages is not None) else None
            stats = RestoreStats(str(path), meta.num_tokens, 0, 0, time.perf_counter() - t0)
            dropped = meta.dropped_messages if messages is not None else 0
            return Restored(cache_for(lm), [], None, {}, messages, stats, dropped, sealed_with=snap.key)
        if pre is not None:
            cache = cache_from_buffer(lm.config, arena.adopt(pre.kv, TORCH_DTYPES[lm.layout.dtype]), hit)
            stored = pre.stored
            pre = None  # the cache holds the buffer now
        else:
            cache, stored = _read_blocks(lm, snap, prompt_ids, hit, num_blocks)
        whole = hit == meta.num_tokens
        logits = snap.last_logits() if whole else None
        encoded = {}
        # Blocks kept as read are written as they are by the next save, if it encodes them the same way.
        if fmt.encodes_like(meta.block_size, meta.codec, meta.storage_layout.dtype):
            for i in range(hit // meta.block_size):
                block = snap.encoded_block(i, stored[i])
                encoded[block.hash] = block
        tokens = snap.tokens[:hit]
        # A partial prefix of a chat is no longer that chat: its messages would not match the tokens.
        messages = list(meta.messages) if (whole and meta.messages is not None) else None
        sealed_with = snap.key
    made_by = (provenance.encode(provenance.parse(meta.extra.get("made_by"))),) * num_blocks
    seconds = time.perf_counter() - t0
    stats = RestoreStats(str(path), meta.num_tokens, hit, num_blocks, seconds, meta.block_size, made_by)
    dropped = meta.dropped_messages if messages is not None else 0
    marks = _marks(lm, meta.extra, messages, tokens)
    return Restored(cache, tokens, logits, encoded, messages, stats, dropped, **marks, sealed_with=sealed_with)


def _read_blocks(lm: LoadedModel, snap: Snapshot, prompt_ids, hit: int, num_blocks: int) -> tuple[KVCache, list]:
    """The first ``num_blocks`` blocks decoded into a cache of ``hit`` tokens, and their stored bytes."""
    meta = snap.meta
    room = max(len(prompt_ids or ()), hit) + DECODE_ROOM
    restorer = KVTransfer(
        lm.layout,
        hit,
        lm.device,
        capacity=room,
        storage_dtype=meta.storage_layout.dtype,
        block_tokens=meta.block_size,
        planes=meta.codec == "shuffle-zstd",
    )
    starts = [i * meta.block_size for i in range(num_blocks)]

    def sink(index: int, raw: np.ndarray) -> None:
        restorer.write(starts[index], meta.blocks[index].num_tokens, raw)

    def target(index: int) -> np.ndarray | None:
        start, n = starts[index], meta.blocks[index].num_tokens
        # Straight into the buffer on the CPU; else into a ring slot, as stored, for the device to finish.
        found = restorer.target(start, n)
        return found if found is not None else restorer.stage(start, n)

    def done(index: int, ok: bool) -> None:
        restorer.done(starts[index], meta.blocks[index].num_tokens, ok)

    stored = snap.read_into(range(num_blocks), sink, target=target, done=done)
    return restorer.finish(lm.config), stored


def from_store(
    lm: LoadedModel,
    store: BlockStore,
    prompt_ids: Sequence[int],
    fmt: BlockFormat,
    *,
    have: int,
    on_problem: Callable[[str], None] | None = None,
    load_ok: LoadOk | None = None,
) -> Restored | None:
    """The longest prefix of ``prompt_ids`` the block store holds, if it is longer than ``have``
    tokens (what the session already holds for this prompt); None otherwise.

    A stored block that turns out damaged is a miss from there on, not a failure: the store drops it
    and ``on_problem`` hears one line about it. With ``on_problem``, a store that cannot be read at
    all (an unreadable index, a full disk) is no store for this request, said in one line; without,
    its ``StoreError`` is raised."""
    from kvsnap.errors import StoreError

    def report(line: str) -> None:
        if on_problem is not None:
            on_problem(line)

    block_size, root = fmt.block_size, fmt.root()
    if have >= len(prompt_ids) // block_size * block_size:
        # The store holds whole blocks only, so it cannot beat that: reading them (and recording their
        # use, an index write) would be wasted work on every turn of a conversation held in memory.
        return None
    t0 = time.perf_counter()
    limit = len(prompt_ids)
    while True:
        try:
            match, blocks = store.fetch(prompt_ids[:limit], root, block_size)
        except StoreError as exc:
            if on_problem is None:
                raise
            on_problem(f"block store not used: {exc}")
            return None
        for line in match.dropped:
            report(line)
        if match.hit_tokens <= have:
            return None
        if load_ok is not None and not load_ok(match.hit_tokens, sum(len(b.data) for b in blocks)):
            return None
        hit = match.hit_tokens
        layout = lm.layout
        room = len(prompt_ids) + DECODE_ROOM
        restorer = KVTransfer(layout, hit, lm.device, capacity=room, block_tokens=block_size)
        failed = _decode_store_blocks(restorer, blocks, block_size, layout.itemsize)
        if failed is None:
            break
        # Its checksum held but it does not decode (an index entry edited by hand): drop it, then
        # take the blocks before it. The shorter prompt ends the loop even if the drop cannot be saved.
        i, exc = failed
        line = str(exc)
        with contextlib.suppress(StoreError):
            line = store.drop_damaged(blocks[i].record.hash, line)
        report(line)
        limit = i * block_size
    encoded = {b.record.hash: b.encoded() for b in blocks if b.record.codec == fmt.codec}
    made_by = tuple(b.record.made_by for b in blocks)
    stats = RestoreStats("store", hit, hit, len(blocks), time.perf_counter() - t0, block_size, made_by)
    return Restored(restorer.finish(lm.config), list(prompt_ids[:hit]), None, encoded, None, stats)


def from_store_session(lm: LoadedModel, store: BlockStore, name: str, fmt: BlockFormat) -> Restored | None:
    """Named store session ``name`` whole (tokens, partial tail, messages, last logits); None when the
    store has no such session. A session recorded under another model, namespace or block size is refused."""
    from kvsnap.errors import ForeignSnapshotError, StoreError

    if name not in {s.name for s in store.sessions()}:
        return None
    t0 = time.perf_counter()
    chain, record, blocks, logits = store.read_session(name)
    if record.root != fmt.root():
        raise ForeignSnapshotError(
            f"store session {name!r} was recorded for another model, namespace or block size "
            f"({chain.model}, block size {chain.block_size}); use another --store-session name"
        )
    if chain.layout != lm.layout:
        raise StoreError(f"store session {name!r}: cache layout {chain.layout.describe()} is not this model's")
    layout = lm.layout
    num_tokens = len(record.token_ids)
    restorer = KVTransfer(
        layout, num_tokens, lm.device, capacity=num_tokens + DECODE_ROOM, block_tokens=chain.block_size
    )
    failed = _decode_store_blocks(restorer, blocks, chain.block_size, layout.itemsize)
    if failed is not None:
        raise failed[1]
    encoded = {b.record.hash: b.encoded() for b in blocks if b.record.full and b.record.codec == fmt.codec}
    last = np.frombuffer(logits, dtype="<f4").copy() if logits is not None else None
    messages = [dict(m) for m in record.messages] if record.messages is not None else None
    dropped = dropped_messages(record.extra, messages)
    if dropped is None:
        raise StoreError(f"store session {name!r}: its {DROPPED_MESSAGES} does not fit its chat messages")
    made_by = tuple(b.record.made_by for b in blocks)
    seconds = time.perf_counter() - t0
    where = f"store session {name!r}"
    stats = RestoreStats(where, num_tokens, num_tokens, len(blocks), seconds, chain.block_size, made_by)
    tokens = list(record.token_ids)
    marks = _marks(lm, record.extra, messages, tokens)
    return Restored(restorer.finish(lm.config), tokens, last, encoded, messages, stats, dropped, **marks)


def _decode_store_blocks(restorer: KVTransfer, blocks, block_size: int, itemsize: int) -> tuple[int, Exception] | None:
    """Decode store blocks (the ``i``-th at token ``i * block_size``) into ``restorer`` on the decode
    threads; the first block in order that does not decode, with its ``StoreError``, or None."""
    from kvsnap.errors import StoreError

    scratch = Scratch()

    def one(i: int) -> StoreError | None:
        block = blocks[i]
        start, n = i * block_size, len(block.record.token_ids)
        try:
            dst = restorer.target(start, n)
            if dst is not None:
                block.decode_into(itemsize, dst)
            else:
                restorer.write(start, n, block.decode(itemsize, out=scratch.get(block.record.raw_bytes)))
        except StoreError as exc:
            return exc
        return None

    for i, exc in enumerate(map_in_order(one, range(len(blocks)))):
        if exc is not None:
            return i, exc
    return None
