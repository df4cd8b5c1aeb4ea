"""Running the model: chunked prefill with explicit positions, one decode step, sampling.

The runner knows nothing about snapshots or hashes: it is handed a cache and token ids, and
it counts every token its forward sees (``tokens_seen``), so "the prefix was skipped" is
measured, not inferred from a plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvsnap import cache as kvcache
from kvsnap.errors import ConfigError
from kvsnap.models import LoadedModel


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` are off."""

    max_new_tokens: int = 256
    temperature: float = 0.7
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ConfigError("max_new_tokens must be >= 0")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError("temperature must be a finite number >= 0")
        if self.top_k < 0:
            raise ConfigError("top_k must be >= 0")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ConfigError("top_p must be in (0, 1]")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ConfigError("seed must be in [0, 2**63)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from last-position logits ``[vocab]``."""
    if params.greedy:
        return int(torch.argmax(logits))
    scores = logits.float() / params.temperature
    if params.top_k and params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cum = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        # Drop tokens once the mass before them already reaches top_p (the first always stays).
        drop = cum - torch.softmax(sorted_scores, dim=-1) >= params.top_p
        scores = scores.scatter(0, order, sorted_scores.masked_fill(drop, float("-inf")))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


class Runner:
    """Forward passes over a cache for one loaded model."""

    def __init__(self, lm: LoadedModel):
        self.lm = lm
        self.tokens_seen = 0  # every token any forward of this runner processed

    def forward(self, cache, token_ids: Sequence[int], start: int) -> torch.Tensor:
        """Run ``token_ids`` at positions ``start..`` over ``cache``; returns last-position logits [vocab]."""
        assert kvcache.cache_length(cache) == start, "cache length must equal the first position"
        dev = self.lm.device
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=dev)  # [1, S]
        positions = torch.arange(start, start + len(token_ids), device=dev).unsqueeze(0)  # [1, S]
        with torch.inference_mode():
            out = self.lm.model(
                input_ids=ids,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,  # only the last position is ever sampled
                **{self.lm.cache_kwarg: cache},
            )
        self.tokens_seen += len(token_ids)
        return out.logits[0, -1].float()

    def prefill(
        self,
        cache,
        token_ids: Sequence[int],
        chunks: Sequence[tuple[int, int]],
        on_chunk: Callable[[int, int], None] | None = None,
    ) -> torch.Tensor | None:
        """Run the planned ``[start, end)`` chunks of ``token_ids`` in order; returns the last logits."""
        logits = None
        done = 0
        total = sum(end - start for start, end in chunks)
        for start, end in chunks:
            logits = self.forward(cache, token_ids[start:end], start)
            done += end - start
            if on_chunk is not None:
                on_chunk(done, total)
        return logits


class TextStream:
    """Incremental detokenization: emits only text that can no longer change."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.emitted = 0
        self.text = ""
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add a token; returns the newly final text (may be empty)."""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = len(text)
        for s in self.stop:
            at = text.find(s)
            if at != -1:
                cut = min(cut, at)
                self.stopped = True
        if self.stopped:
            text = text[:cut]
            safe = len(text)
        else:
            # Hold back an incomplete multi-byte character and a possible start of a stop string.
            safe = len(text.rstrip("\ufffd"))
            for s in self.stop:
                for k in range(min(len(s) - 1, safe), 0, -1):
                    if text[:safe].endswith(s[:k]):
                        safe -= k
                        break
        self.text = text
        if safe <= self.emitted:
            return ""
        delta = text[self.emitted : safe]
        self.emitted = safe
        return delta

    def flush(self) -> str:
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta


@dataclass(frozen=True, slots=True)
class Generation:
    """What one decode loop produced. The last token is sampled but not yet run through the model."""

    token_ids: tuple[int, ...]
    text: str
    stop_reason: str  # "eos" | "stop" | "length" | "interrupted" | "none"
    first_token_at: float | None  # time.perf_counter() of the first sampled token
    last_logits: torch.Tensor  # logits after the last token that was run (not after the pending one)
    forwarded: int  # how many of token_ids were run through the model (all but the last, or fewer)


def generate(
    runner: Runner,
    cache,
    logits: torch.Tensor,
    start: int,
    params: SamplingParams,
    on_text: Callable[[str], None] | None = None,
) -> Generation:
    """Decode from ``logits`` (the logits after position ``start - 1``) until EOS, a stop string or the limit.

    Ctrl-C (KeyboardInterrupt) ends the loop cleanly: the cache is cut back to the tokens that
    were fully run, and the tokens so far are returned with ``stop_reason="interrupted"``.
    """
    import time

    lm = runner.lm
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device="cpu").manual_seed(params.seed)
    stream = TextStream(lm.tokenizer, params.stop)
    ids: list[int] = []
    reason = "none"
    first_at = None
    pos = start
    try:
        for step in range(params.max_new_tokens):
            token = sample(logits.cpu(), params, generator)
            ids.append(token)
            if first_at is None:
                first_at = time.perf_counter()
            delta = stream.push(token)
            if delta and on_text is not None:
                on_text(delta)
            if token in lm.eos_token_ids:
                reason = "eos"
                break
            if stream.stopped:
                reason = "stop"
                break
            if step == params.max_new_tokens - 1:
                reason = "length"
                break
            logits = runner.forward(cache, [token], pos)
            pos += 1
    except KeyboardInterrupt:
        kvcache.crop(cache, pos)
        reason = "interrupted"
        # The last token may or may not have been run; keep only those that surely were plus one pending.
        ids = ids[: pos - start + 1]
    tail = stream.flush()
    if tail and on_text is not None and reason != "interrupted":
        on_text(tail)
    return Generation(tuple(ids), stream.text, reason, first_at, logits, pos - start)
