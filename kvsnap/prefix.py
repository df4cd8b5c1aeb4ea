"""Prefix matching, the suffix chunk plan and the reuse ledger. No torch here.

A snapshot's blocks are matched by chained hash, every hash hit is re-checked against the
stored token ids (a collision must never reuse the wrong KV), then matching continues token by
token into the first differing block or the snapshot's partial tail: a snapshot's tail is
frozen, so reusing part of it is safe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvsnap import hashing


@dataclass(frozen=True, slots=True)
class Match:
    """The reusable prefix of a prompt against a stored token sequence."""

    hit_tokens: int
    block_size: int
    full_blocks: int  # blocks reused whole, hash and tokens checked

    @property
    def num_blocks(self) -> int:
        """Blocks to read: the full ones plus the one holding a token-granular tail, if any."""
        return -(-self.hit_tokens // self.block_size)

    @property
    def last_block_tokens(self) -> int:
        """Tokens used from the last block read (``block_size`` when it is used whole)."""
        if self.hit_tokens == 0:
            return 0
        return self.hit_tokens - (self.num_blocks - 1) * self.block_size


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """What must run through the model for a prompt, given what was reused.

    ``logits_source`` says where the logits that start decoding come from: ``"prefill"``
    (the last chunk), ``"snapshot"`` (stored last-position logits: zero recompute) or
    ``"backoff"`` (the whole prompt hit but no logits were stored for its last position, so the
    last token is recomputed).
    """

    prompt_tokens: int
    hit_tokens: int
    chunks: tuple[tuple[int, int], ...]  # [start, end) token positions, in order
    logits_source: str

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens - self.hit_tokens

    @property
    def chunk_sizes(self) -> list[int]:
        return [end - start for start, end in self.chunks]


@dataclass(frozen=True, slots=True)
class Ledger:
    """The reuse ledger of one request, as reported in ``run --json`` and ``inspect``."""

    prompt_tokens: int
    hit_tokens: int
    prefill_tokens: int
    reuse_ratio: float
    chunks: int

    def as_dict(self) -> dict[str, int | float]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "prefill_tokens": self.prefill_tokens,
            "reuse_ratio": self.reuse_ratio,
            "chunks": self.chunks,
        }

    @classmethod
    def of(cls, plan: PrefillPlan, prefill_tokens: int | None = None) -> Ledger:
        """``prefill_tokens`` defaults to the plan's; the runner passes the count its forward really saw."""
        seen = plan.prefill_tokens if prefill_tokens is None else prefill_tokens
        ratio = plan.hit_tokens / plan.prompt_tokens if plan.prompt_tokens else 0.0
        return cls(plan.prompt_tokens, plan.hit_tokens, seen, round(ratio, 6), len(plan.chunks))


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def matching_blocks(
    prompt_ids: Sequence[int],
    block_size: int,
    root: bytes,
    accept: Callable[[int, bytes, bytes, Sequence[int]], bool],
) -> list[bytes]:
    """Chained hashes of the prompt's leading full blocks, as long as ``accept(i, hash, parent, token_ids)``
    holds: the one walk behind a snapshot's match and the store's.

    ``accept`` must compare the stored token ids, not only the hash: a hash hit is trusted only once
    the tokens compare equal, so a collision stops the match there.
    """
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    hashes: list[bytes] = []
    parent = root
    for i, start in enumerate(range(0, len(prompt_ids) - block_size + 1, block_size)):
        block = prompt_ids[start : start + block_size]
        h = hashing.block_hash(parent, block)
        if not accept(i, h, parent, block):
            break
        hashes.append(h)
        parent = h
    return hashes


def match_prefix(
    prompt_ids: Sequence[int],
    stored_ids: Sequence[int],
    stored_hashes: Sequence[bytes],
    block_size: int,
    root: bytes,
) -> Match:
    """Longest reusable prefix of ``prompt_ids`` in a stored sequence.

    ``stored_hashes`` are the chained hashes of the stored full blocks under ``root``; the
    caller has already checked that the stored chain has this same root (same model,
    namespace and block size), otherwise nothing may be reused.
    """

    def accept(i: int, h: bytes, _parent: bytes, block: Sequence[int]) -> bool:
        start = i * block_size
        return (
            i < len(stored_hashes)
            and h == stored_hashes[i]
            and list(block) == list(stored_ids[start : start + block_size])
        )

    full = len(matching_blocks(prompt_ids, block_size, root, accept))
    hit = full * block_size
    # Then token by token into the first differing block, or the stored partial tail: a stored tail is frozen.
    limit = min(len(prompt_ids), len(stored_ids), hit + block_size)
    while hit < limit and prompt_ids[hit] == stored_ids[hit]:
        hit += 1
    return Match(hit_tokens=hit, block_size=block_size, full_blocks=full)


def chunk_ranges(start: int, end: int, chunk_size: int) -> tuple[tuple[int, int], ...]:
    """``[start, end)`` cut into ``chunk_size`` pieces, the last one short; none when empty."""
    if chunk_size < 1:
        raise ValueError("chunk_size must be >= 1")
    return tuple((s, min(s + chunk_size, end)) for s in range(start, end, chunk_size))


def plan_prefill(
    prompt_tokens: int,
    hit_tokens: int,
    chunk_size: int,
    *,
    logits_at_hit: bool,
) -> PrefillPlan:
    """Plan the suffix prefill after ``hit_tokens`` were reused.

    ``logits_at_hit`` says whether logits for position ``hit_tokens - 1`` are available (the
    snapshot stored them and it ends exactly there). When the whole prompt hit without them,
    the last token is backed off and recomputed so that decoding has logits to start from.
    """
    if not 0 <= hit_tokens <= prompt_tokens:
        raise ValueError(f"hit_tokens {hit_tokens} outside [0, {prompt_tokens}]")
    source = "prefill"
    if prompt_tokens and hit_tokens == prompt_tokens:
        if logits_at_hit:
            source = "snapshot"
        else:
            hit_tokens -= 1
            source = "backoff"
    return PrefillPlan(prompt_tokens, hit_tokens, chunk_ranges(hit_tokens, prompt_tokens, chunk_size), source)
