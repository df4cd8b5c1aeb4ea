"""Is reused KV still right? Recompute restored blocks and compare them with what was restored.

KV read from a snapshot or the store was computed by some earlier run: another kvsnap, torch or
transformers version, another device kind, or a file changed since and re-signed. A change there
(RoPE, attention numerics, a kernel, the bytes) can make it differ from what the running model
computes, and nothing else would notice: the answer is just worse. The check recomputes restored
blocks from their tokens over the restored prefix before each, in a scratch copy of the cache (the
live cache is not touched), and compares for each

- the block's K/V at every layer, recomputed vs restored, and
- the next-token logits at the block's last position, computed over each of the two (the same
  one-token forward both times, so only the KV differs),

each against a tolerance relative to the largest magnitude compared (at least 1): float32 1e-3,
float16 2e-2, bfloat16 5e-2 (``TOLERANCE``). On the default model a float32 recompute on the machine
that made the KV differs by about 1e-6 of the largest value (other chunk sizes sum in another
order), and bfloat16 KV computed another way (a float32 run, rounded) by about 1.7%, its logits by
2.4%: the bounds sit above that noise and far below a real change (another RoPE, other weights:
differences of the order of the values themselves).

Which blocks: on request (``verify=True``) the first restored block, the last (a partial tail too) and
one drawn at random between them, and the stored last logits when they came with the restore. Each
block is recomputed itself because its last layer's K/V feed no layer of any later position, only the
logits, which a recompute of another block computes over the same restored KV both times. By default
(``verify=None``) the last block whose ``made_by`` differs from the running versions or device; nothing
runs, and nothing is paid, when they all match. The report names the blocks and positions it covered.
The cost is each block's prefill plus two one-token forwards, and one copy of the restored KV
(``benchmarks/verify.py``; docs/explain-verify.md).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvsnap import provenance
from kvsnap.engine.cache import KVCache
from kvsnap.engine.results import RestoreStats
from kvsnap.engine.runner import Runner
from kvsnap.models.load import LoadedModel

TOLERANCE = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 5e-2}
RANDOM = random.SystemRandom()


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """One spot check: which blocks, why, the differences found and what they were allowed to be. The
    figures are those of the block closest to (or furthest beyond) its tolerance, ``block``."""

    reason: str  # why it ran: "requested", or what differs ("transformers 4.57.1 -> 5.24.0")
    block: int  # index of the block reported, in the restored source's block size
    start: int  # its token positions [start, end)
    end: int
    tokens: int  # tokens run through the model for the check
    max_abs_diff: float  # K/V of every layer, recomputed vs restored
    logits_max_abs_diff: float  # next-token logits over the recomputed vs the restored KV
    max_abs_allowed: float
    logits_max_abs_allowed: float
    tolerance: float  # relative to the largest magnitude compared (at least 1)
    seconds: float
    refused: str | None = None  # why the reuse was refused (then it was recomputed), None when it passed
    stored_logits_max_abs_diff: float | None = None  # the restored last logits vs computed (last block only)
    blocks: tuple[int, ...] = ()  # every block checked, each recomputed at every layer
    spans: tuple[tuple[int, int], ...] = ()  # their token positions [start, end)

    def ledger(self) -> dict[str, Any]:
        """The fields a ``TurnResult`` gets: ``verify_max_abs_diff``, ``verify_s`` and the details."""
        details = {
            "reason": self.reason,
            "block": self.block,
            "blocks": list(self.blocks),
            "positions": [list(span) for span in self.spans],
            "tokens": self.tokens,
            "logits_max_abs_diff": self.logits_max_abs_diff,
            "max_abs_allowed": self.max_abs_allowed,
            "logits_max_abs_allowed": self.logits_max_abs_allowed,
            "tolerance": self.tolerance,
            "stored_logits_max_abs_diff": self.stored_logits_max_abs_diff,
            "passed": self.refused is None,
        }
        return {"verify": details, "verify_max_abs_diff": self.max_abs_diff, "verify_s": round(self.seconds, 6)}


def device_kind(device: torch.device) -> str:
    """``cpu``, ``mps`` or ``cuda <GPU name>``: kernels, and so numerics, differ between kinds."""
    if device.type == "cuda":
        return f"cuda {torch.cuda.get_device_name(device)}"
    return device.type


def _transformers_version() -> str:
    """The installed transformers' version, without importing it (a process running the native
    forward and the plain tokenizer never does)."""
    import sys

    if "transformers" in sys.modules:
        return sys.modules["transformers"].__version__
    from importlib import metadata

    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        import transformers

        return transformers.__version__


def running_made_by(lm: LoadedModel) -> dict[str, str]:
    """What computes KV in this process (recorded in snapshots and store blocks)."""
    import kvsnap

    return {
        "kvsnap": kvsnap.__version__,
        "torch": torch.__version__,
        "transformers": _transformers_version(),
        "forward": lm.backend,
        "device": device_kind(lm.device),
    }


def recorded(lm: LoadedModel, inherited: Sequence[str]) -> dict[str, Any] | None:
    """The ``made_by`` a save records (None for unknown): the running versions, unless the session holds
    restored KV that other versions made (``inherited``, per block) and no check vouched for. Then that
    record stays (or none), so the next resume checks it again instead of trusting it by its new label."""
    running = running_made_by(lm)
    for text in inherited:
        if provenance.differences(text, running):
            return provenance.parse(text)
    return running


def choose_blocks(
    stats: RestoreStats, num_tokens: int, verify: bool | None, running: dict[str, str], rng: random.Random
) -> tuple[list[int], str] | None:
    """``(blocks, reason)`` to check, or None. On request: the first restored block, the last (a partial
    tail too: its KV is reused like any other) and one drawn at random between them, so a change to any
    block may be the one checked and a change to the first or the last always is. Automatic: the last
    block made by other versions or another device, if any (what changed there is the code, which shows
    in any block)."""
    bs = stats.block_size or num_tokens
    count = -(-num_tokens // bs)
    if verify:
        differs = [d for i in range(count) for d in provenance.differences(_made_by(stats, i), running)]
        reason = "; ".join(dict.fromkeys(differs))
        middle = [rng.randrange(1, count - 1)] if count > 2 else []
        return sorted({0, *middle, count - 1}), "requested" + (f" ({reason})" if reason else "")
    for i in range(count - 1, -1, -1):
        differs = provenance.differences(_made_by(stats, i), running)
        if differs:
            return [i], "; ".join(differs)
    return None


def _made_by(stats: RestoreStats, block: int) -> str | None:
    return stats.made_by[block] if block < len(stats.made_by) else None


def check(
    runner: Runner,
    cache: KVCache,
    tokens: Sequence[int],
    stats: RestoreStats | None,
    verify: bool | None,
    stored_logits: torch.Tensor | None = None,
    rng: random.Random | None = None,
) -> VerifyReport | None:
    """Spot check the KV just restored (``stats``) into ``cache`` for ``tokens``; None when no check was
    due. The live cache is not changed: a report with ``refused`` set says the reuse must be dropped.

    ``stored_logits``: the logits after ``tokens[-1]`` that came with the restore (a snapshot keeps them
    so a prompt it holds whole needs no forward). When the last block is checked, they are compared with
    the logits computed over the restored KV, which the check computes anyway. ``rng`` draws the block
    between the first and the last (``RANDOM``: the operating system's, so a file cannot be changed
    where the check will not look)."""
    n = len(tokens)
    if stats is None or verify is False or not n or not stats.hit_tokens:
        return None
    lm = runner.lm
    chosen = choose_blocks(stats, n, verify, running_made_by(lm), rng or RANDOM)
    if chosen is None:
        return None
    blocks, reason = chosen
    bs = stats.block_size or n
    spans = [(b * bs, min((b + 1) * bs, n)) for b in blocks]
    t0 = time.perf_counter()
    with torch.inference_mode():
        found = _recompute(runner, cache, tokens, spans)
    tol = TOLERANCE[lm.layout.dtype]
    allowed = [(tol * max(1.0, f.kv_scale), tol * max(1.0, f.logits_scale)) for f in found]
    # The block reported: the first one beyond its tolerance, else the one closest to it.
    margins = [max(f.kv / a[0], f.logits / a[1]) if f.kv == f.kv and f.logits == f.logits else math.inf
               for f, a in zip(found, allowed)]  # fmt: skip
    worst = max(range(len(found)), key=lambda i: margins[i])
    (start, end), block, (kv_allowed, logits_allowed) = spans[worst], blocks[worst], allowed[worst]
    kv, logits = found[worst].kv, found[worst].logits
    stored = None
    if stored_logits is not None and spans[-1][1] == n:
        last = found[-1].last_logits
        stored = float((stored_logits.float().reshape(-1) - last.reshape(-1)).abs().max())
    refused = None
    if not (kv <= kv_allowed and logits <= logits_allowed):  # written so that NaN refuses too
        refused = (
            f"reused KV of block {block} (tokens {start:,}-{end - 1:,}) differs from a recompute by {kv:.3g} "
            f"(logits {logits:.3g}), beyond the {lm.layout.dtype} tolerance ({kv_allowed:.3g}, logits "
            f"{logits_allowed:.3g}); checked because: {reason}"
        )
    elif stored is not None and not stored <= allowed[-1][1]:
        refused = (
            f"the stored logits after the last token differ from those computed over the restored KV by "
            f"{stored:.3g}, beyond the {lm.layout.dtype} tolerance ({allowed[-1][1]:.3g}); checked because: {reason}"
        )
    seconds = time.perf_counter() - t0
    return VerifyReport(
        reason,
        block,
        start,
        end,
        sum(e - s + 2 for s, e in spans),
        kv,
        logits,
        kv_allowed,
        logits_allowed,
        tol,
        seconds,
        refused,
        stored,
        tuple(blocks),
        tuple(spans),
    )


@dataclass(frozen=True, slots=True)
class _Found:
    kv: float  # max |difference| of the block's K/V, every layer, recomputed vs restored
    logits: float  # of the logits after its last token, over the recomputed vs the restored KV
    kv_scale: float  # the largest restored magnitudes (K/V, logits)
    logits_scale: float
    last_logits: torch.Tensor  # the recomputed logits after its last token


def _recompute(runner: Runner, live: KVCache, ids: Sequence[int], spans: list[tuple[int, int]]) -> list[_Found]:
    """Each block of ``spans`` (ascending ``[start, end)``) recomputed from its tokens over the restored KV
    before it, compared with the restored KV and logits, in one scratch copy of the restored KV.

    The blocks are taken last first: cropped back to a block's end, the scratch copy holds restored KV
    only (a later block's recompute is cut away), so one copy serves them all."""
    lm = runner.lm
    scratch = live.copy_prefix(lm.config, spans[-1][1] - 1, spans[-1][1])
    found: list[_Found] = []
    for start, end in reversed(spans):
        restored = live.span(start, end).float()
        # Its logits over the restored KV first, then the block recomputed over the restored prefix,
        # then the same logits over the recomputed KV.
        scratch.crop(end - 1)
        logits_restored = runner.forward(scratch, ids[end - 1 : end], end - 1)
        scratch.crop(start)
        runner.forward(scratch, ids[start:end], start)
        recomputed = scratch.span(start, end).float()
        scratch.crop(end - 1)
        logits_recomputed = runner.forward(scratch, ids[end - 1 : end], end - 1)
        found.append(
            _Found(
                float((recomputed - restored).abs().max()),
                float((logits_recomputed - logits_restored).abs().max()),
                float(restored.abs().max()),
                float(logits_restored.abs().max()),
                logits_recomputed.float(),
            )
        )
    return found[::-1]
