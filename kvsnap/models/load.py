"""Loading a model for a ``Session``: device, dtype, weights, tokenizer, cache layout, fingerprint."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvsnap.config import DEFAULT_DEVICE, DEFAULT_DTYPE, DEFAULT_MODEL
from kvsnap.errors import ConfigError, ModelError
from kvsnap.models.fingerprint import config_file, fingerprint_of, fingerprint_parts
from kvsnap.models.resolve import Progress, noop, quiet_transformers, resolve_model
from kvsnap.types import KVLayout


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
    from kvsnap.engine.cache import TORCH_DTYPES

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
    layout: KVLayout
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
    device: str = DEFAULT_DEVICE,
    dtype: str = DEFAULT_DTYPE,
    progress: Progress = noop,
    install: bool = False,
) -> LoadedModel:
    """Load a supported model with its tokenizer, ready for a ``Session``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvsnap.engine import attention, cache

    quiet_transformers()

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
    parts = fingerprint_parts(folder, config_file(folder), layout.dtype)
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
