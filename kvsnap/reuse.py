"""Load a stored prefix or recompute it: the decision, from a cost model measured on this machine.

On a fast GPU a small model may prefill a prefix faster than it can be read from disk and decoded;
on a CPU loading wins at every length. ``auto`` loads only where loading is predicted faster; the
decision never changes the output in float32 or with an exact (batch-invariant) forward, only the
time. No torch here: the model is measured by ``kvsnap.engine.calibrate`` and kept as JSON under
``$KVSNAP_HOME``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvsnap.errors import ConfigError

REUSE_MODES = ("auto", "load", "recompute")
# Bounds of a plausible measurement: a cost model outside them is damaged, not a slow machine.
_MAX_SECONDS = 86_400.0
_MAX_BYTES_PER_S = 1e13


def check_reuse(mode: str) -> None:
    if mode not in REUSE_MODES:
        raise ConfigError(f"--reuse must be auto, load or recompute, not {mode!r}")


@dataclass(frozen=True, slots=True)
class CostModel:
    """Measured costs on one machine, model and device."""

    key: str
    prefill: tuple[tuple[int, float], ...]  # (tokens, seconds) of a cold prefill, by length
    load_bytes_per_s: float  # stored bytes read, checked and decoded into the cache per second
    load_overhead_s: float  # opening a snapshot and building the cache, whatever its size
    loads: tuple[tuple[int, int, float], ...] = ()  # (tokens, stored bytes, seconds) of the restores measured

    def prefill_s(self, tokens: int) -> float:
        """Predicted seconds to prefill ``tokens`` from nothing: linear between measured lengths and
        past the last one (a lower bound there: attention grows faster than linear)."""
        points = [(0, 0.0), *sorted(self.prefill)]
        lengths = [n for n, _ in points]
        i = min(max(bisect.bisect_left(lengths, tokens), 1), len(points) - 1)
        (n0, t0), (n1, t1) = points[i - 1], points[i]
        return t0 + (t1 - t0) * (tokens - n0) / max(n1 - n0, 1)

    def load_s(self, stored_bytes: int) -> float:
        return self.load_overhead_s + stored_bytes / self.load_bytes_per_s

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "prefill": [list(p) for p in self.prefill],
            "load_bytes_per_s": self.load_bytes_per_s,
            "load_overhead_s": self.load_overhead_s,
            "loads": [list(x) for x in self.loads],
        }

    @classmethod
    def from_json(cls, data: Any) -> CostModel:
        """``ValueError`` on anything malformed (a damaged cache file is measured again)."""
        try:
            prefill = tuple((int(n), float(t)) for n, t in data["prefill"])
            loads = tuple((int(n), int(b), float(t)) for n, b, t in data.get("loads", ()))
            model = cls(
                str(data["key"]), prefill, float(data["load_bytes_per_s"]), float(data["load_overhead_s"]), loads
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"malformed cost model ({exc})") from None
        seconds = [t for _, t in prefill] + [t for *_, t in loads] + [model.load_overhead_s]
        if not prefill or not all(math.isfinite(t) and 0 <= t <= _MAX_SECONDS for t in seconds):
            raise ValueError("malformed cost model (no measurements, or seconds out of range)")
        if not (math.isfinite(model.load_bytes_per_s) and 0 < model.load_bytes_per_s <= _MAX_BYTES_PER_S):
            raise ValueError("malformed cost model (load rate out of range)")
        if any(n <= 0 for n, _ in prefill) or any(n <= 0 or b <= 0 for n, b, _ in loads):
            raise ValueError("malformed cost model (sizes out of range)")
        return model


@dataclass(frozen=True, slots=True)
class ReuseDecision:
    """What was decided for one restore, and why; reported in the ledger."""

    mode: str  # what was asked: auto | load | recompute
    decision: str  # what was done: load | recompute
    reason: str
    predicted_load_s: float | None = None
    predicted_recompute_s: float | None = None

    def ledger(self) -> dict[str, Any]:
        """The fields of a request's ledger (``run --json``) that report this decision."""
        return {
            "reuse_decision": self.decision,
            "reuse_reason": self.reason,
            "predicted_load_s": self.predicted_load_s,
            "predicted_recompute_s": self.predicted_recompute_s,
        }


def decide(mode: str, hit_tokens: int, stored_bytes: int, model: CostModel | None) -> ReuseDecision:
    """Load or recompute ``hit_tokens`` tokens held in ``stored_bytes`` stored bytes."""
    check_reuse(mode)
    if mode != "auto":
        return ReuseDecision(mode, mode, f"--reuse {mode}")
    if model is None:
        return ReuseDecision(mode, "load", "not calibrated on this machine (kvsnap calibrate): loading")
    load, recompute = model.load_s(stored_bytes), model.prefill_s(hit_tokens)
    decision = "load" if load <= recompute else "recompute"
    reason = f"predicted load {load:.3f} s vs recompute {recompute:.3f} s"
    return ReuseDecision(mode, decision, reason, round(load, 6), round(recompute, 6))


def fit_load(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(bytes per second, overhead seconds) from (stored bytes, seconds) samples of restores."""
    (b0, t0), (b1, t1) = min(samples), max(samples)
    rate = (b1 - b0) / max(t1 - t0, 1e-9) if b1 > b0 else b1 / max(t1, 1e-9)
    overhead = max(t0 - b0 / rate, 0.0)
    return rate, overhead
