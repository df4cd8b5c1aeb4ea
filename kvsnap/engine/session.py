"""A session: token ids + their KV cache + snapshots. The resume path in one place::

    restore (match the prompt against a .kv file, load only the matched blocks)
      -> prefill (only the unmatched suffix, in chunks)
      -> generate (decode, streaming)
      -> save (only blocks not already encoded)

``Session.run`` is that whole path for one prompt; ``Session.chat`` wraps a user message in the
model's chat template first. The engine matches token ids only: where a template re-renders an
earlier turn differently, only the tokens that compare equal are reused.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvsnap import hashing, prefix
from kvsnap.config import ON_MISMATCH, SamplingParams, SessionConfig, check_choice
from kvsnap.engine import restore as restoring
from kvsnap.engine.cache import KVCache
from kvsnap.engine.chat_template import render_chat
from kvsnap.engine.restore import DECODE_ROOM, RestoreStats
from kvsnap.engine.results import SaveStats, TurnResult
from kvsnap.engine.runner import Generation, Runner, generate
from kvsnap.errors import ConfigError, SnapshotError
from kvsnap.format.meta import SnapshotHeader
from kvsnap.format.writer import encode_block, write_snapshot
from kvsnap.models.load import LoadedModel
from kvsnap.types import KV_DTYPES, EncodedBlock

if TYPE_CHECKING:
    from kvsnap.store import BlockStore

_ENCODE_WORKERS = 4

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
        **settings: Any,
    ):
        """``config`` or its fields as keywords (``block_size``, ``chunk_size``, ``namespace``, ``codec``,
        ``level``, ``kv_dtype``); every default lives in ``kvsnap.config``."""
        if config is None:
            try:
                config = SessionConfig(**settings)
            except TypeError as exc:
                raise ConfigError(str(exc)) from None
        elif settings:
            raise ConfigError("give a SessionConfig or its settings as keywords, not both")
        self.config = config.check(with_store=store is not None)
        self.lm = lm
        self.runner = Runner(lm)
        self.store = store
        # Opt-in narrower storage of the KV in snapshots (lossy for a float32 cache); named in the file.
        self.storage_dtype = config.kv_dtype or lm.layout.dtype
        if store is not None and self.storage_dtype != lm.layout.dtype:
            raise ConfigError("a narrower --kv-dtype is for .kv files; the block store keeps the cache's own dtype")
        self.reset()

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def chunk_size(self) -> int:
        return self.config.chunk_size

    @property
    def namespace(self) -> str:
        return self.config.namespace

    @property
    def codec(self) -> str:
        return self.config.codec

    @property
    def level(self) -> int:
        return self.config.level

    # -- state ------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget everything: tokens, cache, messages."""
        self.tokens: list[int] = []
        self.pending: list[int] = []
        self.cache = KVCache(self.lm.config)
        self.last_logits: torch.Tensor | None = None
        self.messages: list[dict[str, str]] | None = None
        self._encoded: dict[bytes, EncodedBlock] = {}

    def root(self, block_size: int | None = None) -> bytes:
        return hashing.chain_root(self.lm.fingerprint, self.namespace, block_size or self.block_size)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) + len(self.pending)

    @property
    def all_tokens(self) -> list[int]:
        return self.tokens + self.pending

    def _truncate(self, length: int) -> None:
        if length >= len(self.tokens):
            return
        self.cache.crop(length)
        self.tokens = self.tokens[:length]
        self.last_logits = None
        # Blocks past the cut will be recomputed; their encodings must not stand in for the new KV.
        keep = set(hashing.chain_hashes(self.tokens, self.block_size, self.root()))
        self._encoded = {h: b for h, b in self._encoded.items() if h in keep}

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
        self.cache = state.cache
        self.tokens = state.tokens
        self.pending = []
        logits = state.last_logits
        self.last_logits = torch.from_numpy(logits).to(self.lm.device) if logits is not None else None
        self._encoded = state.encoded
        self.messages = state.messages
        return state.stats

    # -- restore -----------------------------------------------------------------------------

    def restore(self, path: str | Path, prompt_ids: Sequence[int] | None = None) -> RestoreStats:
        """Replace the session's state with a snapshot's prefix; the model does not run.

        With ``prompt_ids`` only the longest prefix the prompt shares with the snapshot is read
        (lazily, block by block); without, the whole snapshot and its chat messages. On any error
        the session is left exactly as it was.
        """
        state = restoring.from_snapshot(
            self.lm,
            path,
            self.root,
            prompt_ids,
            block_size=self.block_size,
            codec=self.codec,
            storage_dtype=self.storage_dtype,
        )
        return self._commit(state)

    def restore_from_store(self, prompt_ids: Sequence[int]) -> RestoreStats | None:
        """Take the longest prefix of ``prompt_ids`` held in the block store, if it beats what the
        session already holds for this prompt; returns None when it does not. The model does not run."""
        assert self.store is not None
        have = prefix.common_prefix_len(self.tokens, prompt_ids)
        state = restoring.from_store(
            self.lm, self.store, prompt_ids, self.root(), block_size=self.block_size, codec=self.codec, have=have
        )
        return self._commit(state) if state is not None else None

    def _chain(self):
        from kvsnap.store import ChainInfo

        return ChainInfo(self.root(), self.lm.name, self.lm.fingerprint, self.lm.layout, self.block_size)

    def _blocks_for_store(self, tokens: Sequence[int]) -> list[EncodedBlock | None]:
        """Blocks of ``tokens`` for the store: None for those it holds already, the rest encoded."""
        assert self.store is not None
        known = len(self.store.lookup(tokens, self.root(), self.block_size, touch=False).hashes)
        return [None] * known + self._encode_blocks(tokens, first=known)[0]

    def store_blocks(self) -> int:
        """Add the session's full blocks to the block store (blocks already there are not encoded
        again); returns how many blocks were new to the store."""
        bs = self.block_size
        tokens = self.tokens[: len(self.tokens) // bs * bs]
        if not tokens:
            return 0
        blocks = self._blocks_for_store(tokens)
        return self.store.put(self._chain(), tokens, blocks, codec=self.codec, level=self.level).new_blocks

    def store_session(self, name: str) -> int:
        """Record the whole session in the block store as session ``name`` (sampled tokens run first;
        partial tail block, chat messages and last logits included), which ``kvsnap store pin/export``
        work on; returns how many blocks were new to the store."""
        self.flush()
        if not self.tokens:
            return 0
        blocks = self._blocks_for_store(self.tokens)
        logits = self.last_logits.float().cpu().numpy() if self.last_logits is not None else None
        return self.store.add_session(
            name,
            self._chain(),
            self.tokens,
            blocks,
            codec=self.codec,
            level=self.level,
            messages=self.messages,
            last_logits=logits,
        ).new_blocks

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
        logits_at_hit = hit == len(self.tokens) and self.last_logits is not None
        plan = prefix.plan_prefill(len(prompt), hit, self.chunk_size, logits_at_hit=logits_at_hit)
        self._truncate(plan.hit_tokens)
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
        on_mismatch: str = "error",
        store_session: str | None = None,
    ) -> TurnResult:
        """The whole path for one prompt: restore -> prefill the suffix -> decode.

        ``on_mismatch="recompute"`` turns a refused snapshot (damaged, foreign, too new) into a
        cold run that says why in ``restore_error``; the default raises the ``SnapshotError``.
        """
        check_choice("on_mismatch", on_mismatch, ON_MISMATCH)
        t0 = time.perf_counter()
        restored = None
        restore_error = None
        if resume is not None:
            try:
                restored = self.restore(resume, prompt_ids)
            except SnapshotError as exc:
                if on_mismatch == "error":
                    raise
                restore_error = str(exc)
        store_hit = self.restore_from_store(prompt_ids) if self.store is not None else None
        t1 = time.perf_counter()
        plan, seen = self.prefill(prompt_ids, on_progress)
        t2 = time.perf_counter()
        gen = self.generate(params, on_text) if params.max_new_tokens > 0 else None
        t3 = time.perf_counter()
        store_new = None
        if self.store is not None:
            store_new = self.store_session(store_session) if store_session is not None else self.store_blocks()
        first = gen.first_token_at if gen is not None else None
        return TurnResult(
            **prefix.Ledger.of(plan, seen).as_dict(),
            logits_source=plan.logits_source,
            text=gen.text if gen is not None else "",
            new_tokens=len(gen.token_ids) if gen is not None else 0,
            stop_reason=gen.stop_reason if gen is not None else "none",
            ttft_s=round(first - t0, 6) if first is not None else None,
            restore_s=round(t1 - t0, 6),
            prefill_s=round(t2 - t1, 6),
            decode_s=round(t3 - t2, 6),
            total_s=round(t3 - t0, 6),
            restored_from="store" if store_hit is not None else (str(resume) if restored is not None else None),
            restore_error=restore_error,
            store_new_blocks=store_new,
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
        """One chat turn: append the user message, render, reuse what matches, answer.

        With a block store and ``store_session``, the conversation is recorded there under that name.
        """
        messages = list(self.messages or [])
        if not messages and system:
            messages.append({"role": "system", "content": system})
        messages.append({"role": "user", "content": user_text})
        result = self.run(self.render_chat(messages), params, on_text=on_text, on_progress=on_progress)
        messages.append({"role": "assistant", "content": result.text})
        self.messages = messages
        if self.store is not None and store_session is not None:
            self.store_session(store_session)
        return result

    # -- save --------------------------------------------------------------------------------

    def _encode_blocks(self, tokens: Sequence[int], first: int = 0) -> tuple[list[EncodedBlock], int]:
        """Blocks ``first``.. of ``tokens`` (whose KV is in the cache) as stored, and how many had to be
        encoded: blocks compressed earlier in the session (or read from a snapshot) are reused as
        they are, the rest are encoded in parallel threads."""
        bs = self.block_size
        n = len(tokens)
        hashes = hashing.chain_hashes(tokens, bs, self.root())
        blocks: list[EncodedBlock | None] = []
        todo: list[tuple[int, int, int, bytes | None]] = []
        for i in range(first, -(-n // bs)):
            start, end = i * bs, min((i + 1) * bs, n)
            h = hashes[i] if i < len(hashes) else None
            cached = self._encoded.get(h) if h is not None else None
            if cached is not None and cached.origin is not None and not cached.still_valid():
                cached = None  # a view of a file someone changed in place since it was read: encode afresh
            blocks.append(cached)
            if cached is None:
                todo.append((i - first, start, end, h))
        itemsize = KV_DTYPES[self.storage_dtype]

        def encode(job: tuple[int, int, int, bytes | None]) -> EncodedBlock:
            _, start, end, h = job
            raw = self.cache.block_raw(start, end, self.storage_dtype)
            return encode_block(raw, end - start, h, itemsize, self.codec, self.level, self.storage_dtype)

        with ThreadPoolExecutor(max_workers=_ENCODE_WORKERS) as pool:
            for (i, *_), block in zip(todo, pool.map(encode, todo)):
                blocks[i] = block
                if block.hash is not None:
                    self._encoded[block.hash] = block
        final = [b for b in blocks if b is not None]
        assert len(final) == len(blocks)
        return final, len(todo)

    def save(self, path: str | Path) -> SaveStats:
        """Write the session (every token, prompt and generated) to a ``.kv`` file, atomically.

        Blocks compressed earlier in this session (or read from a snapshot) are written as they
        are; only new blocks are encoded, in parallel threads.
        """
        t0 = time.perf_counter()
        flushed = self.flush()
        n = len(self.tokens)
        final, encoded = self._encode_blocks(self.tokens)
        logits = self.last_logits.float().cpu().numpy() if self.last_logits is not None else None
        header = SnapshotHeader(
            model=self.lm.name,
            fingerprint=self.lm.fingerprint,
            root=self.root(),
            layout=self.lm.layout,
            block_size=self.block_size,
            codec=self.codec,
            level=self.level,
            fingerprint_parts=self.lm.fingerprint_parts,
            storage_dtype=self.storage_dtype,
            # Lets inspect find the tokenizer of a model named by a relative path, a .gguf or a hub id.
            extra={"model_folder": str(Path(self.lm.folder).resolve())},
        )
        size = write_snapshot(path, header, self.tokens, final, last_logits=logits, messages=self.messages)
        self._encoded = {b.hash: b for b in final if b.hash is not None}
        return SaveStats(
            path=str(path),
            tokens=n,
            blocks=len(final),
            blocks_encoded=encoded,
            blocks_reused=len(final) - encoded,
            flushed_tokens=flushed,
            kv_bytes=n * self.lm.layout.bytes_per_token,
            file_bytes=size,
            seconds=time.perf_counter() - t0,
        )
