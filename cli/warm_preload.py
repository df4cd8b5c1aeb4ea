"""What a warm process (cli.warm_server) does before it serves: import, parse ahead, check that no thread runs."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from cli import warm

# What `kvsnap run --resume` imports beyond the CLI (python -X importtime); numpy first (``_preload``).
PRELOAD = (
    "numpy",
    "zstandard",
    "xxhash",
    "safetensors",
    "tokenizers",
    "jinja2.sandbox",  # chat templates (kvsnap.models.chat_jinja): 0.07 s of a --chat run
    "jinja2.ext",
    "torch",
    "torch.nn.functional",
    "kvsnap.config",
    "kvsnap.paths",
    "kvsnap.format.reader",
    "kvsnap.format.writer",
    "kvsnap.format.prefetch",
    "kvsnap.reuse",
    "kvsnap.models.resolve",
    "kvsnap.models.load",
    "kvsnap.models.native",
    "kvsnap.models.plain_tokenizer",
    "kvsnap.models.prepare",
    "kvsnap.engine.session",
    "kvsnap.engine.runner",
    "kvsnap.engine.calibrate",
)

_numpy_threads = 1


def preload() -> float:
    """Import PRELOAD (``check_threads`` then checks they started no thread)."""
    import importlib

    global _numpy_threads
    start = time.perf_counter()
    importlib.import_module(PRELOAD[0])
    # numpy's OpenBLAS starts its workers at import; it stops them around a fork (pthread_atfork).
    _numpy_threads = _native_threads()
    for name in PRELOAD[1:]:
        importlib.import_module(name)
    return time.perf_counter() - start


def parse_ahead(models: list[str]) -> list[str]:
    """Parse the tokenizers of ``models`` that are ready on disk (a folder, or the default model once
    converted; nothing is installed or converted here), for every child to find parsed. Returns the
    models whose tokenizer was."""
    from kvsnap.config import DEFAULT_MODEL
    from kvsnap.errors import KvsnapError
    from kvsnap.models import plain_tokenizer, resolve

    parsed = []
    for spec in models:
        folder = resolve.kvsnap_home() / "models" / DEFAULT_MODEL if spec == DEFAULT_MODEL else Path(spec)
        try:
            ready = resolve.is_ready(folder) if spec == DEFAULT_MODEL else (folder / "config.json").is_file()
            if ready and plain_tokenizer.parse_ahead(folder):
                parsed.append(spec)
        except (KvsnapError, OSError):
            continue
    return parsed


def check_threads() -> None:
    """Refuse to serve if anything but numpy's OpenBLAS started a thread (see the module's docstring)."""
    if threading.active_count() != 1 or _native_threads() > _numpy_threads:
        raise warm.WarmError(
            f"{_native_threads()} threads after the imports ({_numpy_threads} after numpy's): a fork would lose them"
        )


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()
