"""kvsnap: resumable local LLM sessions.

The KV cache is keyed in token blocks by a chained hash and written to a compressed
safetensors ``.kv`` snapshot; a resume loads only the matching prefix (no recompute) and
prefills only the new suffix, in chunks.

    import kvsnap
    lm = kvsnap.load_model()                      # default: smollm2-135m
    s = kvsnap.Session(lm)
    r = s.run(ids, kvsnap.SamplingParams(temperature=0), resume="doc.kv")
    s.save("doc.kv")

Importing this package does not import torch; the names that need it load on first use.
"""

from __future__ import annotations

from typing import Any

from kvsnap.config import DEFAULT_MODEL, SamplingParams, SessionConfig
from kvsnap.errors import (
    ConfigError,
    ContextFullError,
    ForeignSnapshotError,
    KvsnapError,
    ModelError,
    SaveError,
    SnapshotError,
    SnapshotVersionError,
    StoreError,
    UnsupportedModelError,
    VerifyError,
)

__version__ = "0.1.0"

_LAZY = {
    "load_model": "kvsnap.models",
    "resolve_model": "kvsnap.models",
    "LoadedModel": "kvsnap.models",
    "open_session": "kvsnap.engine.assemble",
    "open_store": "kvsnap.engine.assemble",
    "start_packing": "kvsnap.engine.prepare",
    "Session": "kvsnap.engine.session",
    "TurnResult": "kvsnap.engine.results",
    "SaveStats": "kvsnap.engine.results",
    "Snapshot": "kvsnap.format",
    "BlockStore": "kvsnap.store",
}

__all__ = [
    "DEFAULT_MODEL",
    "SamplingParams",
    "SessionConfig",
    "ConfigError",
    "ContextFullError",
    "ForeignSnapshotError",
    "KvsnapError",
    "ModelError",
    "SnapshotError",
    "SnapshotVersionError",
    "SaveError",
    "StoreError",
    "UnsupportedModelError",
    "VerifyError",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvsnap' has no attribute {name!r}")
