"""Is reused KV still right? Recompute one restored block and compare it with what was restored.

KV read from a snapshot or the store was computed by some earlier run: another kvsnap, torch or
transformers version, another device kind. A change there (RoPE, attention numerics, a kernel) can
make it differ from what the running model computes, and nothing else would notice: the answer is
just worse. The check recomputes one restored block from its tokens over the restored prefix before
it, in a scratch copy of the cache (the live cache is not touched), and compares

- the block's K/V, recomputed vs restored, and
- the next-token logits at the block's last position, computed over each of the two (the same
  one-token forward both times, so only the KV differs),

each against a tolerance relative to the largest magnitude compared (at least 1): float32 1e-3,
float16 2e-2, bfloat16 5e-2 (``TOLERANCE``). On the default model a float32 recompute on the machine
that made the KV differs by about 1e-6 of the largest value (other chunk sizes sum in another
order), and bfloat16 KV computed another way (a float32 run, rounded) by about 1.7%, its logits by
2.4%: the bounds sit above that noise and far below a real change (another RoPE, other weights:
differences of the order of the values themselves).

When it runs: on request (``verify=True``: the last restored block, a partial tail too, and the stored
last logits when they came with the restore), or by default when the
versions or device that made a restored block differ from the running ones (``verify=None``: the
last block whose ``made_by`` differs; nothing runs, and nothing is paid, when they all match). The
cost is one block's prefill plus two one-token forwards and a copy of the KV before the block
(docs/explain-verify.md has the measured cost).
"""

from __future__ import annotations

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


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """One spot check: which block, why, the differences found and what they were allowed to be."""

    reason: str  # why it ran: "requested", or what differs ("transformers 4.57.1 -> 5.24.0")
    block: int  # index of the block checked, in the restored source's block size
    start: int  # its token positions [start, end)
    end: int
    tokens: int  # tokens run through the model for the check
    max_abs_diff: float  # K/V, recomputed vs restored
    logits_max_abs_diff: float  # next-token logits over the recomputed vs the restored KV
    max_abs_allowed: float
    logits_max_abs_allowed: float
    tolerance: float  # relative to the largest magnitude compared (at least 1)
    seconds: float
    refused: str | None = None  # why the reuse was refused (then it was recomputed), None when it passed
    stored_logits_max_abs_diff: float | None = None  # the restored last logits vs computed (last block only)

    def ledger(self) -> dict[str, Any]:
        """The fields a ``TurnResult`` gets: ``verify_max_abs_diff``, ``verify_s`` and the details."""
        details = {
            "reason": self.reason,
            "block": self.block,
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


def choose_block(stats: RestoreStats, num_tokens: int, verify: bool | None, running: dict[str, str]):
    """``(block, reason)`` to check, or None: the last restored block on request (a partial tail too: its
    KV is reused like any other), else (automatic) the last block made by other versions or another
    device, if any."""
    bs = stats.block_size or num_tokens
    candidates = range(-(-num_tokens // bs) - 1, -1, -1)
    made_by = stats.made_by
    for i in candidates:
        differs = provenance.differences(made_by[i] if i < len(made_by) else None, running)
        if verify or differs:
            reason = "; ".join(differs)
            return i, ("requested" + (f" ({reason})" if reason else "") if verify else reason)
    return None


def check(
    runner: Runner,
    cache: KVCache,
    tokens: Sequence[int],
    stats: RestoreStats | None,
    verify: bool | None,
    stored_logits: torch.Tensor | None = None,
) -> VerifyReport | None:
    """Spot check the KV just restored (``stats``) into ``cache`` for ``tokens``; None when no check was
    due. The live cache is not changed: a report with ``refused`` set says the reuse must be dropped.

    ``stored_logits``: the logits after ``tokens[-1]`` that came with the restore (a snapshot keeps them
    so a prompt it holds whole needs no forward). When the block checked is the last one, they are
    compared with the logits computed over the restored KV, which the check computes anyway."""
    n = len(tokens)
    if stats is None or verify is False or not n or not stats.hit_tokens:
        return None
    lm = runner.lm
    chosen = choose_block(stats, n, verify, running_made_by(lm))
    if chosen is None:
        return None
    block, reason = chosen
    bs = stats.block_size or n
    start, end = block * bs, min((block + 1) * bs, n)
    t0 = time.perf_counter()
    with torch.inference_mode():
        kv, logits, kv_scale, logits_scale, last = _recompute(runner, cache, tokens, start, end)
    tol = TOLERANCE[lm.layout.dtype]
    kv_allowed, logits_allowed = tol * max(1.0, kv_scale), tol * max(1.0, logits_scale)
    stored = None
    if stored_logits is not None and end == n:
        stored = float((stored_logits.float().reshape(-1) - last.reshape(-1)).abs().max())
    refused = None
    if not (kv <= kv_allowed and logits <= logits_allowed):  # written so that NaN refuses too
        refused = (
            f"reused KV of block {block} (tokens {start:,}-{end - 1:,}) differs from a recompute by {kv:.3g} "
            f"(logits {logits:.3g}), beyond the {lm.layout.dtype} tolerance ({kv_allowed:.3g}, logits "
            f"{logits_allowed:.3g}); checked because: {reason}"
        )
    elif stored is not None and not stored <= logits_allowed:
        refused = (
            f"the stored logits after the last token differ from those computed over the restored KV by "
            f"{stored:.3g}, beyond the {lm.layout.dtype} tolerance ({logits_allowed:.3g}); checked because: {reason}"
        )
    seconds = time.perf_counter() - t0
    return VerifyReport(
        reason,
        block,
        start,
        end,
        end - start + 2,
        kv,
        logits,
        kv_allowed,
        logits_allowed,
        tol,
        seconds,
        refused,
        stored,
    )


def _recompute(
    runner: Runner, live: KVCache, ids: Sequence[int], start: int, end: int
) -> tuple[float, float, float, float, torch.Tensor]:
    """Max |difference| of the K/V of tokens ``[start, end)`` and of the logits after ``end - 1``,
    recomputed vs restored, the largest restored magnitudes (K/V, logits), and the recomputed logits."""
    lm = runner.lm
    restored = live.span(start, end).float()
    # A scratch copy of the restored KV before the last token: its logits over the restored KV first,
    # then the block recomputed over the restored prefix, then the same logits over the recomputed KV.
    scratch = live.copy_prefix(lm.config, end - 1, end)
    logits_restored = runner.forward(scratch, ids[end - 1 : end], end - 1)
    scratch.crop(start)
    runner.forward(scratch, ids[start:end], start)
    recomputed = scratch.span(start, end).float()
    scratch.crop(end - 1)
    logits_recomputed = runner.forward(scratch, ids[end - 1 : end], end - 1)
    kv = float((recomputed - restored).abs().max())
    logits = float((logits_recomputed - logits_restored).abs().max())
    return kv, logits, float(restored.abs().max()), float(logits_restored.abs().max()), logits_recomputed.float()
