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

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvsnap import cache as kvcache
from kvsnap import codec as codecs
from kvsnap import hashing, prefix
from kvsnap.errors import ConfigError, SnapshotError
from kvsnap.models import LoadedModel
from kvsnap.runner import Generation, Runner, SamplingParams, generate
from kvsnap.snapshot import KV_DTYPES, EncodedBlock, Snapshot, encode_block, write_snapshot

if TYPE_CHECKING:
    from kvsnap.store import BlockStore

DEFAULT_BLOCK_SIZE = 64
DEFAULT_CHUNK_SIZE = 512
_ENCODE_WORKERS = 4
_DECODE_ROOM = 256

ProgressFn = Callable[[int, int], None]
TextFn = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class RestoreStats:
    path: str
    snapshot_tokens: int
    hit_tokens: int
    blocks_read: int
    seconds: float


@dataclass(frozen=True, slots=True)
class TurnResult:
    """One request: the reuse ledger, the generated text and where the time went."""

    prompt_tokens: int
    hit_tokens: int
    prefill_tokens: int  # tokens the model's forward really saw for this prompt
    reuse_ratio: float
    chunks: int
    logits_source: str  # "prefill" | "snapshot" | "backoff"
    text: str
    new_tokens: int
    stop_reason: str
    ttft_s: float | None
    restore_s: float
    prefill_s: float
    decode_s: float
    total_s: float
    restored_from: str | None = None
    restore_error: str | None = None  # the snapshot was refused and everything recomputed (on_mismatch="recompute")
    store_new_blocks: int | None = None  # blocks this request added to the block store (None: no store)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class SaveStats:
    path: str
    tokens: int
    blocks: int
    blocks_encoded: int  # compressed in this save
    blocks_reused: int  # already compressed earlier in the session
    flushed_tokens: int  # sampled tokens run through the model so the file covers them
    kv_bytes: int
    file_bytes: int
    seconds: float


def check_codec(codec: str) -> None:
    """Refuse an unknown snapshot codec (the CLI calls this before loading a model)."""
    if codec not in codecs.ALL_CODECS:
        raise ConfigError(f"unknown codec {codec!r} (known: {', '.join(codecs.ALL_CODECS)})")


class Session:
    """Tokens whose KV is held in ``cache`` (plus at most the sampled tokens not yet run), chat messages.

    Invariants: ``cache`` holds exactly ``len(tokens)`` positions; ``last_logits`` are the logits
    after ``tokens[-1]`` (or None); ``pending`` were sampled but not run through the model.
    """

    def __init__(
        self,
        lm: LoadedModel,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        namespace: str = "",
        codec: str = codecs.DEFAULT_CODEC,
        level: int = codecs.DEFAULT_LEVEL,
        store: BlockStore | None = None,
        kv_dtype: str | None = None,
    ):
        if block_size < 1:
            raise ConfigError("block_size must be >= 1")
        if chunk_size < 1:
            raise ConfigError("chunk_size must be >= 1")
        check_codec(codec)
        if store is not None and codec in codecs.LOSSY_CODECS:
            raise ConfigError("a lossy codec is for .kv files; blocks in the store are shared and kept exact")
        self.lm = lm
        self.runner = Runner(lm)
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.namespace = namespace
        self.codec = codec
        self.level = level
        self.store = store
        # Opt-in narrower storage of the KV in snapshots (lossy for a float32 cache); named in the file.
        self.storage_dtype = kv_dtype or lm.layout.dtype
        if self.storage_dtype not in KV_DTYPES:
            raise ConfigError(f"unknown KV storage dtype {kv_dtype!r} (known: {', '.join(KV_DTYPES)})")
        if store is not None and self.storage_dtype != lm.layout.dtype:
            raise ConfigError("a narrower --kv-dtype is for .kv files; the block store keeps the cache's own dtype")
        self.reset()

    # -- state ------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget everything: tokens, cache, messages."""
        self.tokens: list[int] = []
        self.pending: list[int] = []
        self.cache = kvcache.new_cache(self.lm.config)
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
        kvcache.crop(self.cache, length)
        self.tokens = self.tokens[:length]
        self.last_logits = None
        # Blocks past the cut will be recomputed; their encodings must not stand in for the new KV.
        keep = set(hashing.chain_hashes(self.tokens, self.block_size, self.root()))
        self._encoded = {h: b for h, b in self._encoded.items() if h in keep}

    # -- restore -----------------------------------------------------------------------------

    def restore(self, path: str | Path, prompt_ids: Sequence[int] | None = None) -> RestoreStats:
        """Replace the session's state with a snapshot's prefix; the model does not run.

        With ``prompt_ids`` only the longest prefix the prompt shares with the snapshot is read
        (lazily, block by block); without, the whole snapshot and its chat messages. On any error
        the session is left exactly as it was.
        """
        t0 = time.perf_counter()
        with Snapshot(path) as snap:
            meta = snap.meta
            root = self.root(meta.block_size)
            snap.check_compatible(
                model=self.lm.name,
                fingerprint=self.lm.fingerprint,
                root=root,
                layout=self.lm.layout,
                fingerprint_parts=self.lm.fingerprint_parts,
            )
            if prompt_ids is None:
                hit = meta.num_tokens
            else:
                hit = prefix.match_prefix(prompt_ids, snap.tokens, meta.block_hashes, meta.block_size, root).hit_tokens
            num_blocks = -(-hit // meta.block_size)
            # Room for the suffix and a first answer, so they are written in place.
            room = max(len(prompt_ids or ()), hit) + _DECODE_ROOM
            restorer = kvcache.Restorer(
                self.lm.layout, hit, self.lm.device, capacity=room, storage_dtype=meta.storage_layout.dtype
            )
            starts = [i * meta.block_size for i in range(num_blocks)]

            def sink(index: int, raw) -> None:
                restorer.write(starts[index], meta.blocks[index].num_tokens, raw)

            _, stored = snap.read_blocks(range(num_blocks), keep_stored=True, sink=sink)
            whole = hit == meta.num_tokens
            logits = snap.last_logits() if whole else None
            cache = restorer.finish(self.lm.config)
            encoded = {}
            same_encoding = (meta.codec, meta.storage_layout.dtype) == (self.codec, self.storage_dtype)
            if meta.block_size == self.block_size and same_encoding:
                for i in range(hit // meta.block_size):
                    block = snap.encoded_block(i, stored[i])
                    encoded[block.hash] = block
            tokens = snap.tokens[:hit]
            messages = list(meta.messages) if (whole and meta.messages is not None) else None
        # Commit only now that everything was read and checked.
        self.cache = cache
        self.tokens = tokens
        self.pending = []
        self.last_logits = torch.from_numpy(logits).to(self.lm.device) if logits is not None else None
        self._encoded = encoded
        # A partial prefix of a chat is no longer that chat: its messages would not match the tokens.
        self.messages = messages
        return RestoreStats(str(path), meta.num_tokens, hit, num_blocks, time.perf_counter() - t0)

    def restore_from_store(self, prompt_ids: Sequence[int]) -> RestoreStats | None:
        """Take the longest prefix of ``prompt_ids`` held in the block store, if it beats what the
        session already holds for this prompt; returns None when it does not. The model does not run."""
        assert self.store is not None
        t0 = time.perf_counter()
        have = prefix.common_prefix_len(self.tokens, prompt_ids)
        match, blocks = self.store.fetch(prompt_ids, self.root(), self.block_size)
        if match.hit_tokens <= have:
            return None
        hit = match.hit_tokens
        layout = self.lm.layout
        restorer = kvcache.Restorer(layout, hit, self.lm.device, capacity=len(prompt_ids) + _DECODE_ROOM)
        scratch = np.empty(self.block_size * layout.bytes_per_token, dtype=np.uint8)
        for i, block in enumerate(blocks):
            restorer.write(i * self.block_size, self.block_size, block.decode(layout.itemsize, out=scratch))
        cache = restorer.finish(self.lm.config)
        self.cache = cache
        self.tokens = list(prompt_ids[:hit])
        self.pending = []
        self.last_logits = None
        self._encoded = {b.record.hash: b.encoded() for b in blocks if b.record.codec == self.codec}
        return RestoreStats("store", hit, hit, len(blocks), time.perf_counter() - t0)

    def save_to_store(self, name: str | None = None) -> int:
        """Add the session's full blocks to the block store (blocks already there are not encoded
        again); returns how many blocks were new to the store.

        With ``name`` the whole session (sampled tokens run first, partial tail block, chat
        messages and last logits included) is also recorded as a named store session, which
        ``kvsnap store pin/export`` work on.
        """
        assert self.store is not None
        from kvsnap.store import ChainInfo

        if name is not None:
            self.flush()
        bs = self.block_size
        tokens = self.tokens if name is not None else self.tokens[: len(self.tokens) // bs * bs]
        if not tokens:
            return 0
        root = self.root()
        known = len(self.store.lookup(tokens, root, bs, touch=False).hashes)
        blocks: list[EncodedBlock | None] = [None] * known
        blocks += self._encode_blocks(tokens, first=known)[0]
        chain = ChainInfo(root, self.lm.name, self.lm.fingerprint, self.lm.layout, bs)
        if name is None:
            return self.store.put(chain, tokens, blocks, codec=self.codec, level=self.level).new_blocks
        logits = self.last_logits.float().cpu().numpy() if self.last_logits is not None else None
        return self.store.add_session(
            name, chain, tokens, blocks, codec=self.codec, level=self.level, messages=self.messages, last_logits=logits
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
            kvcache.reserve(self.cache, len(prompt) + _DECODE_ROOM, self.lm.layout, self.lm.device)
        seen0 = self.runner.tokens_seen
        try:
            logits = self.runner.prefill(self.cache, prompt, plan.chunks, on_progress)
        except BaseException:
            kvcache.crop(self.cache, len(self.tokens))  # a half-run chunk must not stay in the cache
            raise
        self.tokens = prompt
        if logits is not None:
            self.last_logits = logits
        return plan, self.runner.tokens_seen - seen0

    def flush(self) -> int:
        """Run sampled-but-pending tokens through the model, so the cache covers every token."""
        if not self.pending:
            return 0
        n = len(self.pending)
        try:
            self.last_logits = self.runner.forward(self.cache, self.pending, len(self.tokens))
        except BaseException:
            kvcache.crop(self.cache, len(self.tokens))  # a half-run forward must not stay in the cache
            raise
        self.tokens += self.pending
        self.pending = []
        return n

    def generate(self, params: SamplingParams, on_text: TextFn | None = None) -> Generation:
        """Decode after the current tokens. The last sampled token stays pending until needed."""
        self.flush()
        if self.last_logits is None:
            raise ConfigError("nothing to continue from: prefill a prompt first")
        try:
            gen = generate(self.runner, self.cache, self.last_logits, len(self.tokens), params, on_text)
        except BaseException:
            # generate() handles Ctrl-C itself; any other error (a failing on_text callback, the model)
            # would leave KV for tokens the session does not hold: drop them, keep the session as it was.
            kvcache.crop(self.cache, len(self.tokens))
            raise
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
        if on_mismatch not in ("error", "recompute"):
            raise ConfigError(f"on_mismatch must be 'error' or 'recompute', not {on_mismatch!r}")
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
        store_new = self.save_to_store(store_session) if self.store is not None else None
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
        tok = self.lm.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ConfigError(f"model {self.lm.name} has no chat template; give a raw prompt instead")
        text = tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)
        return list(tok(text, add_special_tokens=False)["input_ids"])

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
            self.save_to_store(store_session)
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
            raw = kvcache.block_raw(self.cache, start, end, self.storage_dtype)
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
        bs = self.block_size
        n = len(self.tokens)
        final, encoded = self._encode_blocks(self.tokens)
        logits = self.last_logits.float().cpu().numpy() if self.last_logits is not None else None
        size = write_snapshot(
            path,
            model=self.lm.name,
            fingerprint=self.lm.fingerprint,
            root=self.root(),
            layout=self.lm.layout,
            block_size=bs,
            codec=self.codec,
            level=self.level,
            tokens=self.tokens,
            blocks=final,
            last_logits=logits,
            messages=self.messages,
            fingerprint_parts=self.lm.fingerprint_parts,
            storage_dtype=self.storage_dtype,
            extra={"model_folder": str(Path(self.lm.folder).resolve())},
        )
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
