"""This machine's load-or-recompute cost model for a loaded model: where it is kept, reading it back,
and the decision it makes. Measuring it is ``kvsnap.engine.calibrate``'s job.

The cache file is input like any other: it is read only if it is a regular file of bounded size
holding a well-formed model with finite, plausible figures; anything else is as if it were absent.
A location that cannot be written keeps the measurement for the rest of the process.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import threading
from pathlib import Path

import torch

from kvsnap import __version__
from kvsnap.errors import KvsnapError
from kvsnap.models.catalog import kvsnap_home
from kvsnap.models.load import LoadedModel
from kvsnap.paths import check_save_target, json_object
from kvsnap.reuse import CostModel, ReuseDecision, decide

_MAX_FILE = 1 << 20  # a cost model is a few hundred bytes
_lock = threading.Lock()
# By cache path: measured in this process, whether or not the file could be written; and the files
# that could not be.
_in_process: dict[Path, CostModel] = {}
_not_kept: set[Path] = set()


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


def cached(lm: LoadedModel) -> CostModel | None:
    """The cost model measured for ``lm`` on this machine (in this process, or kept on disk), or None."""
    key, path = machine_key(lm), cache_path(lm)
    with _lock:
        if path in _in_process:
            return _in_process[path]
    raw = json_object(path, _MAX_FILE)
    if raw is None:
        return None
    try:
        model = CostModel.from_json(raw)
    except ValueError:
        return None
    return model if model.key == key else None


def keep(lm: LoadedModel, model: CostModel) -> bool:
    """Remember ``model`` for this process and write it to ``cache_path``; False when the file could not
    be written (the process still uses it: it is measured once per process at most)."""
    path = cache_path(lm)
    with _lock:
        _in_process[path] = model
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        check_save_target(path, error=KvsnapError)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(model.to_json()))
        os.replace(tmp, path)
    except (OSError, KvsnapError):
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        with _lock:
            _not_kept.add(path)
        return False
    return True


def kept_on_disk(lm: LoadedModel) -> bool:
    """False when this process measured ``lm``'s cost model but could not write it (it is used anyway)."""
    with _lock:
        return cache_path(lm) not in _not_kept


def decide_for(lm: LoadedModel, mode: str, hit_tokens: int, stored_bytes: int) -> ReuseDecision:
    """``kvsnap.reuse.decide`` with this machine's cost model, if it was measured.

    A library call never measures on its own (that would run the model behind the caller's back):
    without a cost model ``auto`` loads. The CLI measures once, with progress, when a decision needs it.
    """
    return decide(mode, hit_tokens, stored_bytes, cached(lm) if mode == "auto" else None)
