"""Picking tokens from logits, and turning tokens back into text as they come. No model here.

``SamplingParams`` (torch-free, so the CLI checks it before loading anything) lives in
``kvsnap.config``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvsnap.config import SamplingParams

__all__ = ["SamplingParams", "TextStream", "sample"]


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
        # A top_p below float32's smallest number compares as 0, which would drop every token.
        drop[0] = False
        scores = scores.scatter(0, order, sorted_scores.masked_fill(drop, float("-inf")))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


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


# A sequence of this many tokens or more is a loop at its third copy: a sentence a model writes three times
# running ("A: The peak day demand was July 23, 2025." again and again) is never meant.
LONG_PERIOD = 8


def is_looping(ids: Sequence[int], *, max_period: int = 32, min_span: int = 32, min_repeats: int = 4) -> bool:
    """Whether the last tokens repeat one short sequence over and over ("La USA, la USA, ..."): the
    tail is ``period`` tokens repeated at least ``min_repeats`` times (3 from ``LONG_PERIOD`` tokens on)
    and ``min_span`` tokens long.

    Small models fall into such loops at any temperature; without this check an answer runs to
    the token limit (a runaway the user had to stop with Ctrl-C).
    """
    n = len(ids)
    for period in range(1, max_period + 1):
        span = max(min_span, period * (min(min_repeats, 3) if period >= LONG_PERIOD else min_repeats))
        if span > n:
            break
        tail = ids[n - span :]
        if all(tail[i] == tail[i - period] for i in range(period, span)):
            return True
    return False
