"""Measure, once per machine, model and device, what a prefill costs and what a restore costs.

The result (``kvsnap.reuse.CostModel``) is cached as JSON under ``$KVSNAP_HOME/calibration`` and
used by ``--reuse auto``; ``kvsnap calibrate`` measures again. Token ids are a fixed pattern over
the vocabulary: cost depends on length, not content.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvsnap import __version__
from kvsnap.config import SessionConfig
from kvsnap.models.load import LoadedModel
from kvsnap.models.resolve import kvsnap_home
from kvsnap.reuse import CostModel, ReuseDecision, decide, fit_load

LENGTHS = (64, 256, 1024)
REPEATS = 2


def machine_key(lm: LoadedModel) -> str:
    """What the costs depend on: the model, its dtype, the device, torch, kvsnap and this machine."""
    device = str(lm.device)
    if lm.device.type == "cuda":
        device += ":" + torch.cuda.get_device_name(lm.device)
    parts = [
        lm.fingerprint,
        lm.layout.dtype,
        device,
        torch.__version__,
        __version__,
        platform.node(),
        str(os.cpu_count()),
    ]
    return hashlib.blake2b("|".join(parts).encode(), digest_size=12).hexdigest()


def cache_path(lm: LoadedModel) -> Path:
    """Where the cost model is kept: ``$KVSNAP_CALIBRATION`` if set (the tests give each test its own),
    else ``$KVSNAP_HOME/calibration``."""
    folder = os.environ.get("KVSNAP_CALIBRATION") or kvsnap_home() / "calibration"
    return Path(folder) / f"{machine_key(lm)}.json"


def cost_model(
    lm: LoadedModel, *, measure: bool = True, progress: Callable[[str], None] | None = None
) -> CostModel | None:
    """The cached cost model of ``lm`` here; measured now (and cached) if there is none and ``measure``."""
    path = cache_path(lm)
    try:
        model = CostModel.from_json(json.loads(path.read_text()))
        if model.key == machine_key(lm):
            return model
    except (OSError, ValueError):
        pass
    if not measure:
        return None
    return calibrate(lm, progress=progress)


def calibrate(lm: LoadedModel, *, progress: Callable[[str], None] | None = None) -> CostModel:
    """Time cold prefills at a few lengths and restores of the same KV from a page-cached ``.kv``."""
    from kvsnap.engine.session import Session

    say = progress or (lambda _msg: None)
    from kvsnap.models.load import max_positions_of

    # The model's own context, not a --ctx-size: the cost model is kept per machine and model.
    limit = max_positions_of(lm.config) or max(LENGTHS)
    lengths = [n for n in LENGTHS if n < limit] or [max(limit // 2, 1)]
    vocab = int(getattr(lm.config, "vocab_size", 0) or len(lm.tokenizer))
    ids = [(i * 7919 + 13) % vocab for i in range(max(lengths))]
    config = SessionConfig(reuse="load")  # what is measured must not itself ask for a measurement
    prefill: list[tuple[int, float]] = []
    loads: list[tuple[int, int, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in lengths:
            say(f"calibrating load vs recompute (once per machine): {n} tokens")
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
    model = CostModel(machine_key(lm), tuple(prefill), rate, overhead, tuple(loads))
    path = cache_path(lm)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(model.to_json()))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home measures again next time
    return model


def decide_for(lm: LoadedModel, mode: str, hit_tokens: int, stored_bytes: int) -> ReuseDecision:
    """``kvsnap.reuse.decide`` with this machine's cost model, if it was measured.

    A library call never measures on its own (that would run the model behind the caller's back):
    without a cost model ``auto`` loads. The CLI measures once, with progress, on first use.
    """
    return decide(mode, hit_tokens, stored_bytes, cost_model(lm, measure=False) if mode == "auto" else None)
