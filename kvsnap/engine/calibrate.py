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
# A prefill that takes LONG_S is timed once, and once a length's prefill takes LONG_S and CLEAR_RATIO
# times its restore, longer lengths are not measured: a prefill grows at least linearly with the tokens
# and a restore linearly, so they could not turn the decision. Measuring every length twice would take
# over 20 minutes for an 8B model on 2 CPU cores, before the first resume.
LONG_S = 2.0
CLEAR_RATIO = 4.0


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
            session = Session(lm, config)
            prefill.append((n, _best_of(_prefill, session, ids[:n])))
            path = Path(tmp) / f"{n}.kv"
            session.save(path)
            loads.append((n, path.stat().st_size, _best_of(_restore, lm, config, path)))
            if prefill[-1][1] >= max(LONG_S, CLEAR_RATIO * loads[-1][2]):
                break
    rate, overhead = fit_load([(b, t) for _, b, t in loads])
    model = CostModel(costs.machine_key(lm), tuple(prefill), rate, overhead, tuple(loads))
    costs.keep(lm, model)
    return model


def _best_of(run: Callable[..., None], *args: object) -> float:
    """The shortest of REPEATS timed runs, or of one that took LONG_S."""
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        run(*args)
        best = min(best, time.perf_counter() - t0)
        if best >= LONG_S:
            break
    return best


def _prefill(session: Session, ids: list[int]) -> None:
    session.reset()
    session.prefill(ids)


def _restore(lm: LoadedModel, config: SessionConfig, path: Path) -> None:
    Session(lm, config).restore(path)
    if lm.device.type == "cuda":
        torch.cuda.synchronize(lm.device)
