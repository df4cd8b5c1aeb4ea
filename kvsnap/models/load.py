"""Loading a model for a ``Session``: device, dtype, weights, tokenizer, cache layout, fingerprint."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvsnap import limits
from kvsnap.config import DEFAULT_DEVICE, DEFAULT_DTYPE, DEFAULT_MODEL, DEFAULT_QUANTIZE
from kvsnap.errors import ConfigError, KvsnapError, ModelError
from kvsnap.models import catalog
from kvsnap.models.fingerprint import config_file, fingerprint_of, fingerprint_parts
from kvsnap.models.generation_files import end_of_turn_ids, generation_eos, sampling_defaults_of
from kvsnap.models.resolve import Progress, is_ready, noop, quiet_transformers, resolve_model
from kvsnap.paths import json_object
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
    from kvsnap.models.architecture import TORCH_DTYPES

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
    max_positions: int | None = None  # the context in tokens (None: the config states none and none was asked for)
    context_source: str = limits.MODEL_CONTEXT  # or limits.ASKED_CONTEXT: a ctx_size set max_positions
    # Sampling settings the model ships in generation_config.json (temperature, top_p, top_k), if any.
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    # Seconds each step of ``load_model`` took, in order (imports, config, model class, weights, ...):
    # what a new process spends before its first token (benchmarks/startup.py).
    load_timings: dict[str, float] = field(default_factory=dict)
    backend: str = "transformers"  # or "native": kvsnap.models.native runs the forward
    quantization: str = "none"  # int8, int4: the weights were quantized at load (kvsnap.models.quantize)

    @property
    def kv_dtype(self) -> str:
        return self.layout.dtype


# RoPE scalings that stretch a pretrained context of ``original_max_position_embeddings`` (else
# ``max_position_embeddings``) by ``factor``; "llama3" states the stretched length in ``max_position_embeddings``
# already. "dynamic" and "longrope" switch frequencies mid-sequence instead: their context is ``rope_window``.
_STRETCHING_ROPE = ("linear", "yarn")


def max_positions_of(config) -> int | None:
    """The most positions the model attends over, as its transformers config says (None if it does not);
    for a RoPE that switches frequencies by the sequence length, the window where they are fixed."""
    from kvsnap.models.architecture import rope_window

    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    n = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    window = rope_window(text)
    if window is not None:
        return window if not isinstance(n, int) or isinstance(n, bool) or n < 1 else min(n, window)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return None
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in _STRETCHING_ROPE:
        factor = rope.get("factor")
        original = rope.get("original_max_position_embeddings") or n
        if isinstance(factor, (int, float)) and factor > 1 and isinstance(original, int):
            n = max(n, int(original * factor))
    return n


def load_tokenizer(folder: Path, *, plain: bool = False):
    """The folder's tokenizer, as ``AutoTokenizer`` gives it.

    ``plain`` (a native Llama model): a folder whose tokenizer_config.json names ``TokenizersBackend``
    and no custom code gets that class, which is where ``AutoTokenizer`` ends for the llama model
    type (not for qwen2 or mistral, which it maps to their own classes), without the config import
    it makes on the way; and where ``plain_tokenizer`` takes the folder, its
    ``tokenizer.json`` on the ``tokenizers`` library, without importing transformers at all.
    """
    if plain:
        from kvsnap.models.plain_tokenizer import plain_tokenizer

        found = plain_tokenizer(folder)
        if found is not None:
            return found
    quiet_transformers()
    if plain and _names_tokenizers_backend(folder):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend as auto
    else:
        from transformers import AutoTokenizer as auto
    try:
        return auto.from_pretrained(str(folder))
    except Exception as exc:
        raise ModelError(f"cannot load the tokenizer from {folder}: {exc}") from None


def _names_tokenizers_backend(folder: Path) -> bool:
    raw = json_object(folder / "tokenizer_config.json")
    return raw is not None and raw.get("tokenizer_class") == "TokenizersBackend" and "auto_map" not in raw


def load_model(
    spec: str = DEFAULT_MODEL,
    *,
    device: str = DEFAULT_DEVICE,
    dtype: str = DEFAULT_DTYPE,
    progress: Progress = noop,
    install: bool = False,
    check_layout: Callable[[KVLayout], object] | None = None,
    ctx_size: int | None = None,
    quantize: str = DEFAULT_QUANTIZE,
) -> LoadedModel:
    """Load a supported model with its tokenizer, ready for a ``Session``.

    ``check_layout`` (e.g. ``SessionConfig.check_layout``) sees the cache layout before the weights
    load, so a setting the model cannot take fails in a second, not after the load. ``ctx_size``
    caps the tokens a session holds (prompt and answer) below the model's context (``--ctx-size``):
    a longer prompt is refused, generation stops there, and a process that reserves KV memory
    (``preload``) reserves that much. ``quantize`` (none, int8, int4, auto: a GGUF's own class) quantizes
    the weights at load, one linear at a time (``kvsnap.models.quantize``).
    """
    timings: dict[str, float] = {}
    mark = _Stopwatch(timings)
    folder = resolve_model(spec, progress=progress, install=install)
    mark("resolve")
    # A new process imports torch (and transformers, where it is needed) here: most of its start.
    import torch  # noqa: F401

    mark("torch")
    from kvsnap.models import architecture, native, native_config, quantized_load
    from kvsnap.models.quantize import kv_dtype

    mark("kvsnap.engine")
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    quantization = _quantization(quantize, folder, dev)  # before the weights load
    raw_config = config_file(folder)
    use_native = native_config.enabled() and dev.type == "cpu"
    config = native_config.plain_config(raw_config) if use_native else None
    if config is None:
        config = _transformers_config(folder, mark)
    mark("config")  # with the import of transformers' config classes, unless native read it
    architecture.check_supported(config)
    layout = architecture.layout_of(config, kv_dtype(quantization, torch_dtype, dev))
    if check_layout is not None:
        check_layout(layout)
    if ctx_size is not None:  # before the weights load, like the layout
        architecture.check_rope_window(ctx_size, config)  # first: its refusal says why
        limits.check_ctx_size(ctx_size, max_positions_of(config))
    progress(f"loading {spec}")
    model = None
    quantized = False  # the model's weights were quantized (or mapped quantized) already
    if use_native and native_config.unsupported_reason(config, dev) is None:
        try:
            if quantization != "none":
                model = quantized_load.native_model(
                    folder, config, raw_config, torch_dtype, quantization, _tied_aliases(folder), progress, mark
                )
                quantized = True
            else:
                model = native.load(folder, config, torch_dtype, _tied_aliases(folder))
        except native.NotNative:
            # Not exactly its tensors: transformers loads the folder, or says in its own words what is wrong.
            model = None
        except (KvsnapError, MemoryError):
            raise
        except Exception:
            model = None  # a file native cannot map: transformers says what is wrong with it
        mark("weights")
    if model is None:
        if getattr(config, "plain", False):  # a transformers model takes transformers' config and cache
            config = _transformers_config(folder, mark)
        model = _load_with_transformers(folder, config, dev, torch_dtype, mark)
    try:
        model.to(dev).eval()
    except (RuntimeError, MemoryError) as exc:
        raise ModelError(f"cannot place {spec} on {dev}: {str(exc).splitlines()[0] if str(exc) else exc}") from None
    mark("place")
    if quantization != "none" and not quantized:
        from kvsnap.models.fused import fuse
        from kvsnap.models.quantize import apply

        apply(model, quantization, torch_dtype)
        fuse(model)  # one product for q/k/v and for gate/up in a decode step
    mark("quantize")
    tokenizer = load_tokenizer(folder, plain=isinstance(model, native.NativeCausalLM) and config.model_type == "llama")
    mark("tokenizer")
    # The quantized model's own name: which kernels ran it is part of what its KV is (kvsnap.models.quantize).
    parts = fingerprint_parts(folder, raw_config, layout.dtype, getattr(model, "quantization", quantization))
    mark("fingerprint")
    eos = set(generation_eos(folder))
    for source in (getattr(model, "generation_config", None), config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            eos.add(value)
        elif isinstance(value, (list, tuple)):
            eos.update(v for v in value if isinstance(v, int))
    eos.update(end_of_turn_ids(tokenizer))
    if quantization != "none":  # the load's float temporaries are gone: their pages go back too
        from kvsnap.models.quantize import return_freed_memory

        return_freed_memory()
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
        cache_kwarg=architecture.forward_cache_kwarg(model),
        eos_token_ids=frozenset(eos),
        max_positions=max_positions_of(config) if ctx_size is None else ctx_size,
        context_source=_context_source(config, ctx_size),
        sampling_defaults=sampling_defaults_of(folder),
        load_timings=timings,
        backend="native" if isinstance(model, native.NativeCausalLM) else "transformers",
        quantization=quantization,
    )


def _quantization(mode: str, folder: Path, device: Any) -> str:
    """The quantization ``mode`` asks for the model in ``folder`` on ``device`` (``auto``: on the CPU, the class
    of the GGUF it came from; on a GPU none, where quantized products dequantize and are not tuned)."""
    from kvsnap import quantization

    if quantization.check_mode(mode) == "auto" and device.type != "cpu":
        return "none"
    source = catalog.marker(folder).get("source") if mode == "auto" else None
    if not isinstance(source, str):
        return quantization.resolve(mode, None)
    from kvsnap.models.gguf_codes import layer_types

    types = layer_types(Path(source))
    return quantization.resolve(mode, quantization.class_of_gguf_types(list(types.values())) if types else None)


def _context_source(config, ctx_size: int | None) -> str:
    """What sets ``LoadedModel.max_positions``, as messages name it."""
    from kvsnap.models.architecture import rope_window

    if ctx_size is not None:
        return limits.ASKED_CONTEXT
    window = rope_window(config)
    return limits.ROPE_CONTEXT if window is not None and window == max_positions_of(config) else limits.MODEL_CONTEXT


def _transformers_config(folder: Path, mark: Callable[[str], None]):
    quiet_transformers()
    mark("transformers")  # the package's top level, which any use of it imports first
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder))
    except Exception as exc:
        raise ModelError(f"cannot read the model config in {folder}: {exc}") from None


def _load_with_transformers(folder: Path, config, dev, torch_dtype, mark: Callable[[str], None]):
    quiet_transformers()
    from transformers import AutoModelForCausalLM

    from kvsnap.models import attention

    attention.register()
    mark("attention")  # registering kvsnap_sdpa imports transformers.modeling_utils, which any model needs
    implementation = attention.implementation_for(dev, _import_model_class(config))
    mark("model_class")
    try:
        model = _from_pretrained(AutoModelForCausalLM, folder, torch_dtype, implementation)
    except Exception as exc:
        raise ModelError(f"cannot load the model in {folder}: {exc}") from None
    mark("weights")
    return model


class _Stopwatch:
    """``mark(step)`` records the seconds since the previous mark under ``step``."""

    def __init__(self, into: dict[str, float]):
        self.into = into
        self.last = time.perf_counter()

    def __call__(self, step: str) -> None:
        now = time.perf_counter()
        self.into[step] = self.into.get(step, 0.0) + now - self.last
        self.last = now


def _import_model_class(config) -> type | None:
    """The model type's causal-LM class, its modeling module imported now (else ``from_pretrained`` does),
    so a load's time says what importing it costs apart from the weights; None for a type without
    one, left for ``from_pretrained`` to refuse in its own words."""
    try:
        from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except Exception:
        return None


def _from_pretrained(auto, folder: Path, dtype, implementation: str):
    """``from_pretrained`` on the folder; for a model kvsnap converted itself, with the tied embedding
    read under the name transformers fills first (``_tied_aliases``). The result is the same model."""
    aliases = _tied_aliases(folder)
    if aliases:
        mapping = {f"^{re.escape(kept)}$": dropped for dropped, kept in aliases.items()}
        model, info = auto.from_pretrained(
            str(folder), dtype=dtype, attn_implementation=implementation, key_mapping=mapping, output_loading_info=True
        )
        clean = not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"))
        if clean and all(_same_tensor(model, dropped, kept) for dropped, kept in aliases.items()):
            return model
        del model  # not a plain tie of every name the file holds: load the file as it is written
    return auto.from_pretrained(str(folder), dtype=dtype, attn_implementation=implementation)


def _tied_aliases(folder: Path) -> dict[str, str]:
    """Tensors a kvsnap GGUF conversion wrote once for two names: ``{dropped name: kept name}``.

    safetensors' ``save_model`` keeps one name of a shared tensor (for a tied embedding, the output
    layer's ``lm_head.weight``) and notes the other in the file's metadata. transformers then loads
    ``lm_head.weight``, fills ``model.embed_tokens.weight`` with random numbers (seconds
    for a large vocabulary) and ties the two, overwriting
    them. Read under the embedding's name, the tensor is tied without the random fill. Only folders
    kvsnap converted (ready marker, one ``model.safetensors``) are read this way.
    """
    path = folder / "model.safetensors"
    if not is_ready(folder) or not path.is_file():
        return {}
    try:
        from safetensors import safe_open

        with safe_open(str(path), "np") as f:
            names = set(f.keys())
            metadata = f.metadata() or {}
    except Exception:
        return {}  # from_pretrained reports a bad file in its own words
    return {
        dropped: kept
        for dropped, kept in metadata.items()
        if isinstance(kept, str) and kept in names and dropped not in names
    }


def _same_tensor(model, a: str, b: str) -> bool:
    try:
        return model.get_parameter(a) is model.get_parameter(b)
    except AttributeError:
        return False
