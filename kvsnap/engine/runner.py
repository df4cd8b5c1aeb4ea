"""Running the model: chunked prefill with explicit positions, one decode step, the decode loop.

The runner knows nothing about snapshots or hashes: it is handed a cache and token ids, and
it counts every token its forward sees (``tokens_seen``), so "the prefix was skipped" is
measured, not inferred from a plan.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvsnap import limits
from kvsnap.config import SamplingParams
from kvsnap.engine.cache import KVCache
from kvsnap.engine.sampling import TextStream, is_looping, sample
from kvsnap.errors import ConfigError
from kvsnap.models import quantize
from kvsnap.models.load import LoadedModel


class Runner:
    """Forward passes over a cache for one loaded model."""

    def __init__(self, lm: LoadedModel, exact: bool = False):
        """``exact``: every forward batch-invariant (``kvsnap.models.exact``; the native forward only). A
        native model quantized on torch's CPU kernels always runs so (``quantize.runs_exact``)."""
        if exact and lm.backend != "native":
            raise ConfigError(f"exact needs kvsnap's native forward; this model runs the {lm.backend} one")
        self.lm = lm
        self.exact = exact or (lm.backend == "native" and quantize.runs_exact(lm.model))
        self.tokens_seen = 0  # every token any forward of this runner processed

    def forward(self, cache: KVCache, token_ids: Sequence[int], start: int) -> torch.Tensor:
        """Run ``token_ids`` at positions ``start..`` over ``cache``; returns last-position logits [vocab]."""
        assert cache.length == start, "cache length must equal the first position"
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
                **({"exact": True} if self.exact else {}),
            )
        self.tokens_seen += len(token_ids)
        return out.logits[0, -1].float()

    def prefill(
        self,
        cache: KVCache,
        token_ids: Sequence[int],
        chunks: Sequence[tuple[int, int]],
        on_chunk: Callable[[int, int], None] | None = None,
    ) -> torch.Tensor | None:
        """Run the planned ``[start, end)`` chunks of ``token_ids`` in order; returns the last logits."""
        if chunks:  # no position past the model's context (Session.run refuses such a prompt before any work)
            limits.check_tokens(len(token_ids), self.lm.max_positions, self.lm.context_source)
        logits = None
        done = 0
        total = sum(end - start for start, end in chunks)
        for start, end in chunks:
            logits = self.forward(cache, token_ids[start:end], start)
            done += end - start
            if on_chunk is not None:
                on_chunk(done, total)
        return logits


@dataclass(frozen=True, slots=True)
class Generation:
    """What one decode loop produced. The last token is sampled but not yet run through the model."""

    token_ids: tuple[int, ...]
    text: str
    stop_reason: str  # "eos" | "stop" | "length" | "context" (full) | "repetition" | "interrupted" | "none"
    first_token_at: float | None  # time.perf_counter() of the first sampled token
    last_logits: torch.Tensor  # logits after the last token that was run (not after the pending one)
    forwarded: int  # how many of token_ids were run through the model (all but the last, or fewer)


def generate(
    runner: Runner,
    cache: KVCache,
    logits: torch.Tensor,
    start: int,
    params: SamplingParams,
    on_text: Callable[[str], None] | None = None,
) -> Generation:
    """Decode from ``logits`` (the logits after position ``start - 1``) until EOS, a stop string, the limit
    or the model's context: no token is placed past the context (it is also all a snapshot holds).

    Ctrl-C (KeyboardInterrupt) ends the loop cleanly: the cache is cut back to the tokens that
    were fully run, and the tokens so far are returned with ``stop_reason="interrupted"``.
    """
    lm = runner.lm
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device="cpu").manual_seed(params.seed)
    stream = TextStream(lm.tokenizer, params.stop)
    ids: list[int] = []
    reason = "none"
    first_at = None
    pos = start  # where the next sampled token sits
    context, _ = limits.token_limit(lm.max_positions, lm.context_source)
    try:
        for step in range(params.max_new_tokens):
            if pos >= context:
                reason = "context"
                break
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
            if params.stop_loops and is_looping(ids):
                reason = "repetition"
                break
            if step == params.max_new_tokens - 1:
                reason = "length"
                break
            if pos + 1 >= context:  # this token fills the last position: nothing after it fits
                reason = "context"
                break
            logits = runner.forward(cache, [token], pos)
            pos += 1
    except KeyboardInterrupt:
        cache.crop(pos)
        reason = "interrupted"
        # The last token may or may not have been run; keep only those that surely were plus one pending.
        ids = ids[: pos - start + 1]
    tail = stream.flush()
    if tail and on_text is not None and reason != "interrupted":
        on_text(tail)
    return Generation(tuple(ids), stream.text, reason, first_at, logits, pos - start)
