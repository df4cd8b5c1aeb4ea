"""A session: token ids + their KV cache + snapshots. The resume path in one place::

    restore (match the prompt against a .kv file, load only the matched blocks)
      -> prefill (only the unmatched suffix, in chunks)
      -> generate (decode, streaming)
      -> save (only blocks not already encoded)

``Session.run`` is that whole path for one prompt; ``Session.chat`` wraps a user message in the
model's chat template first, appended to the ids the chat already ran (``kvsnap.conversation``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvsnap import conversation, hashing, limits, prefix, sealing
from kvsnap.config import SamplingParams, SessionConfig
from kvsnap.engine import costs, snapshot_save, store_save
from kvsnap.engine import explain_sources as explaining
from kvsnap.engine import restore as restoring
from kvsnap.engine import verify as verifying
from kvsnap.engine.cache import cache_for
from kvsnap.engine.chat import chat_turn
from kvsnap.engine.chat_template import render_chat
from kvsnap.engine.contents import Contents
from kvsnap.engine.encoded import EncodedBlocks
from kvsnap.engine.restore import DECODE_ROOM
from kvsnap.engine.results import RestoreStats, SaveStats, TurnResult
from kvsnap.engine.runner import Generation, Runner, generate
from kvsnap.engine.verify import VerifyReport
from kvsnap.errors import ConfigError, SnapshotError, StoreError, VerifyError
from kvsnap.models.load import LoadedModel
from kvsnap.types import BlockFormat, chat_view

if TYPE_CHECKING:
    from kvsnap.reuse import ReuseDecision
    from kvsnap.store import BlockStore

ProgressFn = Callable[[int, int], None]
TextFn = Callable[[str], None]

__all__ = ["RestoreStats", "SaveStats", "Session", "TurnResult"]


class Session:
    """Tokens whose KV is held in ``cache`` (plus at most the sampled tokens not yet run), chat messages.

    Invariants: ``cache`` holds exactly ``len(tokens)`` positions; ``last_logits`` are the logits
    after ``tokens[-1]`` (or None); ``pending`` were sampled but not run through the model.
    """

    def __init__(
        self,
        lm: LoadedModel,
        config: SessionConfig | None = None,
        *,
        store: BlockStore | None = None,
        measure_costs: Callable[[LoadedModel], object] | None = None,
        **settings: Any,
    ):
        """``config`` or its fields as keywords (``block_size``, ``chunk_size``, ``namespace``, ``codec``,
        ``level``, ``kv_dtype``, ...); every default lives in ``kvsnap.config``.

        ``measure_costs(lm)``: called when ``reuse="auto"`` must decide whether to load a stored prefix
        and this machine's cost model is not measured yet (``kvsnap.engine.calibrate.calibrate``, with
        progress shown). Without it, an unmeasured machine loads: the library never runs the model to
        measure behind its caller's back."""
        if config is None:
            try:
                config = SessionConfig(**settings)
            except TypeError as exc:
                raise ConfigError(str(exc)) from None
        elif settings:
            raise ConfigError("give a SessionConfig or its settings as keywords, not both")
        self.config = config.check(with_store=store is not None).check_layout(lm.layout)
        self.lm = lm
        self.runner = Runner(lm, exact=config.exact)
        self.store = store
        self.measure_costs = measure_costs
        # Opt-in narrower storage of the KV in snapshots (lossy for a float32 cache); named in the file.
        storage_dtype = config.kv_dtype or lm.layout.dtype
        if store is not None and storage_dtype != lm.layout.dtype:
            raise ConfigError("a narrower --kv-dtype is for .kv files; the block store keeps the cache's own dtype")
        self.block_format = BlockFormat(
            lm.fingerprint, config.namespace, config.block_size, config.codec, config.level, storage_dtype
        )
        self.reset()

    block_size = property(lambda self: self.config.block_size)
    namespace = property(lambda self: self.config.namespace)
    codec = property(lambda self: self.config.codec)

    # -- state ------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget everything: tokens, cache, messages."""
        self.tokens: list[int] = []
        self.pending: list[int] = []
        self.cache = cache_for(self.lm)
        self.last_logits: torch.Tensor | None = None
        self.messages: list[dict[str, str]] | None = None
        self.dropped_messages = 0  # of ``messages``, out of the model's view (kvsnap.engine.chat_view)
        self.turn_ends: conversation.TurnEnds = []  # where each exchange ends in ``all_tokens`` (kvsnap.conversation)
        self.encoded = EncodedBlocks()  # blocks already encoded as a save would write them
        self.inherited_made_by: tuple[str, ...] = ()  # restored KV's provenance, per block (verify.recorded)
        self.last_reuse: ReuseDecision | None = None  # the last load-or-recompute decision
        self.sealed_with: sealing.SealKey | None = None  # the key of an encrypted snapshot read since the reset

    def root(self, block_size: int | None = None) -> bytes:
        return self.block_format.root(block_size)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) + len(self.pending)

    @property
    def all_tokens(self) -> list[int]:
        return self.tokens + self.pending

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` tokens (and their KV); what was sampled and not yet run goes too
        when anything is cut. Nothing is recomputed."""
        if length >= len(self.tokens):
            return
        self.cache.crop(length)
        self.tokens = self.tokens[:length]
        self.last_logits = None
        self.turn_ends = conversation.ends_within(self.turn_ends, length)
        # Blocks past the cut will be recomputed; their encodings must not stand in for the new KV.
        keep = set(hashing.chain_hashes(self.tokens, self.block_size, self.root()))
        self.encoded.keep_only(keep)

    @contextlib.contextmanager
    def _rollback_on_error(self) -> Iterator[None]:
        """A forward that fails half way (an error, Ctrl-C) must not leave KV for tokens the session
        does not hold: the cache is cut back to ``tokens`` and the error goes on."""
        try:
            yield
        except BaseException:
            self.cache.crop(len(self.tokens))
            raise

    def _commit(self, state: restoring.Restored) -> RestoreStats:
        """Take a restored state whole (only once everything was read and checked)."""
        # A prefix restored for a prompt keeps the turn ends it still holds (a chat's earlier exchanges).
        kept = conversation.ends_within(self.turn_ends, prefix.common_prefix_len(self.all_tokens, state.tokens))
        self.cache, self.tokens = state.cache, state.tokens
        self.pending, self.turn_ends = list(state.pending), list(state.turn_ends) or kept
        logits = state.last_logits
        self.last_logits = torch.from_numpy(logits).to(self.lm.device) if logits is not None else None
        self.encoded = EncodedBlocks(state.encoded)
        self.messages, self.dropped_messages = state.messages, state.dropped_messages
        self.inherited_made_by = state.stats.made_by
        self.sealed_with = state.sealed_with or self.sealed_with
        return state.stats

    def restore(self, path: str | Path, prompt_ids: Sequence[int] | None = None) -> RestoreStats:
        """Replace the session's state with a snapshot's prefix; the model does not run.

        With ``prompt_ids`` only the longest prefix the prompt shares with the snapshot is read
        (lazily, block by block); without, the whole snapshot and its chat messages. On any error
        the session is left exactly as it was.
        """
        state = restoring.from_snapshot(
            self.lm, path, self.block_format, prompt_ids, load_ok=self._load_ok, key=self.config.key
        )
        return self._commit(state)

    def _load_ok(self, hit_tokens: int, stored_bytes: int) -> bool:
        """Load a stored prefix, or recompute it (``config.reuse``); the decision goes to the ledger.
        Called only once the source was checked against this model and a prefix matched: the cost model
        is measured (``measure_costs``) only when a decision needs it, never before a refusal."""
        if self.config.reuse == "auto" and self.measure_costs is not None and costs.cached(self.lm) is None:
            self.measure_costs(self.lm)
        self.last_reuse = costs.decide_for(self.lm, self.config.reuse, hit_tokens, stored_bytes)
        return self.last_reuse.decision == "load"

    def restore_from_store(self, prompt_ids: Sequence[int], on_problem: TextFn | None = None) -> RestoreStats | None:
        """Take the longest prefix of ``prompt_ids`` held in the block store, if it beats what the session
        holds for this prompt, else None; the model does not run. ``on_problem``: see ``restore.from_store``."""
        assert self.store is not None
        have = prefix.common_prefix_len(self.tokens, prompt_ids)
        state = restoring.from_store(
            self.lm, self.store, prompt_ids, self.block_format, have=have, on_problem=on_problem, load_ok=self._load_ok
        )
        return self._commit(state) if state is not None else None

    def restore_store_session(self, name: str) -> RestoreStats | None:
        """Resume named store session ``name`` whole (messages and KV, zero recompute); None when the
        store holds no such session."""
        assert self.store is not None
        state = restoring.from_store_session(self.lm, self.store, name, self.block_format)
        return self._commit(state) if state is not None else None

    def store_blocks(self) -> int:
        """Add the session's full blocks to the block store (blocks already there are not encoded
        again); returns how many blocks were new to the store."""
        assert self.store is not None
        return store_save.store_blocks(self.store, self.contents())

    def store_session(self, name: str) -> int:
        """Record the whole session in the block store as session ``name`` (sampled tokens run first;
        partial tail block, chat messages and last logits included), which ``kvsnap store pin/export``
        work on; returns how many blocks were new to the store."""
        assert self.store is not None
        self.flush()
        return store_save.store_session(self.store, self.contents(), name)

    def contents(self) -> Contents:
        """What the session holds, for writing it out (sampled tokens not yet run stay out)."""
        made_by = verifying.recorded(self.lm, self.inherited_made_by)
        held = (self.tokens, self.cache, self.encoded, self.last_logits, self.messages, made_by, self.dropped_messages)
        marks = conversation.record(self.turn_ends, self.pending) if self.messages else {}
        # Sealed with --encrypt's key, else that of an encrypted snapshot or store it came from.
        key = sealing.save_key(self.config.key, self.sealed_with, self.store.key if self.store is not None else None)
        return Contents(self.lm, self.block_format, *held, key=key, marks=marks)

    def verify_restored(self, stats: RestoreStats | None) -> VerifyReport | None:
        """Spot check what was just restored (``config.verify``; see ``kvsnap.engine.verify``); None when
        no check was due. A difference beyond the tolerance drops everything restored (the messages stay):
        ``config.on_mismatch="error"`` then raises ``VerifyError``, ``"recompute"`` returns the report and
        the next prefill computes the prompt whole."""
        report = verifying.check(self.runner, self.cache, self.tokens, stats, self.config.verify, self.last_logits)
        if report is None:
            return None
        if report.refused is not None:
            # Nothing restored is trusted now, not even the prefix before the block.
            self.truncate(0)
        self.inherited_made_by = ()  # checked (or dropped): what the session holds is its own now
        if report.refused is not None and self.config.on_mismatch == "error":
            raise VerifyError(f"{report.refused}; not reused")
        return report

    # -- prefill and decode -------------------------------------------------------------------

    def prefill(
        self, prompt_ids: Sequence[int], on_progress: ProgressFn | None = None
    ) -> tuple[prefix.PrefillPlan, int]:
        """Make the cache hold ``prompt_ids``: reuse the common prefix, run only the rest, in chunks.

        Returns the plan and the number of tokens the model's forward really saw.
        """
        prompt = list(prompt_ids)
        if not prompt:
            raise ConfigError("the prompt is empty")
        hit = prefix.common_prefix_len(self.tokens, prompt)
        self.turn_ends = conversation.ends_within(self.turn_ends, prefix.common_prefix_len(self.all_tokens, prompt))
        logits_at_hit = hit == len(self.tokens) and self.last_logits is not None
        plan = prefix.plan_prefill(len(prompt), hit, self.config.chunk_size, logits_at_hit=logits_at_hit)
        self.truncate(plan.hit_tokens)
        self.pending = []
        if plan.chunks:
            self.cache.reserve(len(prompt) + DECODE_ROOM, self.lm.layout, self.lm.device)
        seen0 = self.runner.tokens_seen
        with self._rollback_on_error():
            logits = self.runner.prefill(self.cache, prompt, plan.chunks, on_progress)
        self.tokens = prompt
        if logits is not None:
            self.last_logits = logits
        return plan, self.runner.tokens_seen - seen0

    def flush(self) -> int:
        """Run sampled-but-pending tokens through the model, so the cache covers every token."""
        if not self.pending:
            return 0
        n = len(self.pending)
        with self._rollback_on_error():
            self.last_logits = self.runner.forward(self.cache, self.pending, len(self.tokens))
        self.tokens += self.pending
        self.pending = []
        return n

    def generate(self, params: SamplingParams, on_text: TextFn | None = None) -> Generation:
        """Decode after the current tokens. The last sampled token stays pending until needed."""
        self.flush()
        if self.last_logits is None:
            raise ConfigError("nothing to continue from: prefill a prompt first")
        # generate() handles Ctrl-C itself; any other error (a failing on_text callback, the model) keeps
        # the session as it was.
        with self._rollback_on_error():
            gen = generate(self.runner, self.cache, self.last_logits, len(self.tokens), params, on_text)
        self.tokens += list(gen.token_ids[: gen.forwarded])
        self.pending = list(gen.token_ids[gen.forwarded :])
        self.last_logits = gen.last_logits
        return gen

    def run(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        resume: str | Path | None = None,
        on_text: TextFn | None = None,
        on_progress: ProgressFn | None = None,
        store_session: str | None = None,
        on_generated: Callable[[Generation | None], None] | None = None,
        prompt_messages: Sequence[dict[str, str]] | None = None,
    ) -> TurnResult:
        """The whole path for one prompt: restore -> prefill the suffix -> decode.

        ``config.on_mismatch="recompute"`` turns a refused snapshot (damaged, foreign, too new, or failing
        ``config.verify``'s check) into a cold run that says why in ``restore_error``; ``"error"`` raises
        the ``SnapshotError``. ``on_generated(gen)`` is called once decoding is done, before anything is
        written to the store. ``prompt_messages``: the chat messages ``prompt_ids`` render (explain uses them).
        """
        limits.check_tokens(len(prompt_ids), self.lm.max_positions, self.lm.context_source)  # before any work
        t0 = time.perf_counter()
        self.last_reuse = None
        restored = None
        restore_error = None
        held = (list(self.tokens), self.messages)
        if resume is not None:
            try:
                restored = self.restore(resume, prompt_ids)
            except SnapshotError as exc:
                if self.config.on_mismatch == "error":
                    raise
                restore_error = str(exc)
        store_problems: list[str] = []  # a store that cannot be read or written is no store for this request
        store_hit = self.restore_from_store(prompt_ids, store_problems.append) if self.store is not None else None
        checked = self.verify_restored(store_hit or restored)
        restore_error = restore_error or (checked.refused if checked is not None else None)
        t1 = time.perf_counter()
        plan, seen = self.prefill(prompt_ids, on_progress)
        t2 = time.perf_counter()
        gen = self.generate(params, on_text) if params.max_new_tokens > 0 else None
        t3 = time.perf_counter()
        miss = None  # explained before this request's blocks join the store, and outside the timings
        if self.config.explain:
            kw = dict(resume=resume, held=held, prompt_messages=prompt_messages)
            miss = explaining.for_session(self, prompt_ids, plan.hit_tokens, **kw)
        if on_generated is not None:
            on_generated(gen)
        store_new = None
        if self.store is not None:
            try:
                store_new = self.store_session(store_session) if store_session is not None else self.store_blocks()
            except StoreError as exc:
                store_problems.append(f"block store not updated: {exc}")
        return TurnResult.of(
            prefix.Ledger.of(plan, seen).as_dict(),
            gen,
            (t0, t1, t2, t3),
            logits_source=plan.logits_source,
            restored_from="store" if store_hit is not None else (str(resume) if restored is not None else None),
            restore_error=restore_error,
            store_new_blocks=store_new,
            store_error="; ".join(store_problems) or None,
            **(self.last_reuse.ledger() if self.last_reuse is not None else {}),
            **(checked.ledger() if checked is not None else {}),
            miss=miss.as_dict() if miss is not None else None,
        )

    # -- chat --------------------------------------------------------------------------------

    def render_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` in the model's chat template."""
        return render_chat(self.lm, messages, add_generation_prompt)

    def chat(
        self,
        user_text: str,
        params: SamplingParams,
        *,
        system: str | None = None,
        on_text: TextFn | None = None,
        on_progress: ProgressFn | None = None,
        store_session: str | None = None,
    ) -> TurnResult:
        """One chat turn: append the user message to the ids already run, answer (see ``engine.chat``). A
        conversation that outgrows the context drops its oldest turns from view (``config.on_context_full``);
        with a block store and ``store_session``, it is recorded there under that name."""
        kw = dict(system=system, on_text=on_text, on_progress=on_progress, store_session=store_session)
        return chat_turn(self, user_text, params, **kw)

    @property
    def view_messages(self) -> list[dict[str, str]] | None:
        """The messages the model sees: ``messages`` without the ``dropped_messages`` after the system ones."""
        return chat_view(self.messages, self.dropped_messages) if self.messages is not None else None

    # -- save --------------------------------------------------------------------------------

    def save(self, path: str | Path, *, flush: bool = True) -> SaveStats:
        """Write the session (every token, prompt and generated) to a ``.kv`` file, atomically.

        Blocks compressed earlier in this session (or read from a snapshot) are written as they
        are; only new blocks are encoded, in parallel threads. ``flush=False``: sampled tokens not yet
        run through the model stay out of the file (a save that must not run the model: background_save).
        """
        flushed = self.flush() if flush else 0
        return snapshot_save.save(self.contents(), path, flushed=flushed)
