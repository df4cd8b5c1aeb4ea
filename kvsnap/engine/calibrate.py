"""Measure, once per machine, model and dtype, what a prefill costs and what a restore costs.

The result (``kvsnap.reuse.CostModel``) is kept by ``kvsnap.engine.costs`` and used by ``--reuse
auto``; ``kvsnap calibrate`` measures again. Token ids are a fixed pattern over the vocabulary: cost
depends on length, not content.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvsnap import limits
from kvsnap.config import SessionConfig
from kvsnap.engine import costs
from kvsnap.engine.session import Session
from kvsnap.models.load import LoadedModel, max_positions_of
from kvsnap.reuse import CostModel, fit_load

LENGTHS = (64, 256, 1024)
REPEATS = 2


def cost_model(
    lm: LoadedModel, *, measure: bool = True, progress: Callable[[str], None] | None = None
) -> CostModel | None:
    """The cost model of ``lm`` here (measured in this process or kept on disk); measured now if there is
    none and ``measure``."""
    model = costs.cached(lm)
    if model is not None or not measure:
        return model
    return calibrate(lm, progress=progress)


def calibrate(lm: LoadedModel, *, progress: Callable[[str], None] | None = None) -> CostModel:
    """Time cold prefills at a few lengths and restores of the same KV from a page-cached ``.kv``."""
    say = progress or (lambda _msg: None)
    # The model's own context, not a --ctx-size: the cost model is kept per machine and model, so it is
    # measured at the same lengths whatever context this process asked for.
    own = max_positions_of(lm.config)
    limit = own or max(LENGTHS)
    lengths = [n for n in LENGTHS if n < limit] or [max(limit // 2, 1)]
    lm = dataclasses.replace(lm, max_positions=own, context_source=limits.MODEL_CONTEXT)
    vocab = int(getattr(lm.config, "vocab_size", 0) or len(lm.tokenizer))
    ids = [(i * 7919 + 13) % vocab for i in range(max(lengths))]
    config = SessionConfig(reuse="load")  # what is measured must not itself ask for a measurement
    prefill: list[tuple[int, float]] = []
    loads: list[tuple[int, int, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in lengths:
            say(f"measuring load vs recompute for this model and dtype: {n} tokens")
            best = float("inf")
            session = Session(lm, config)
            for _ in range(REPEATS):
                session.reset()
                t0 = time.perf_counter()
                session.prefill(ids[:n])
                best = min(best, time.perf_counter() - t0)
            prefill.append((n, best))
            path = Path(tmp) / f"{n}.kv"
            session.save(path)
            stored = path.stat().st_size
            best = float("inf")
            for _ in range(REPEATS):
                other = Session(lm, config)
                t0 = time.perf_counter()
                other.restore(path)
                if lm.device.type == "cuda":
                    torch.cuda.synchronize(lm.device)
                best = min(best, time.perf_counter() - t0)
            loads.append((n, stored, best))
    rate, overhead = fit_load([(b, t) for _, b, t in loads])
    model = CostModel(costs.machine_key(lm), tuple(prefill), rate, overhead, tuple(loads))
    costs.keep(lm, model)
    return model
