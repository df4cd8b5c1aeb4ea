"""What a model's config says about its KV cache: the layout kvsnap keys and stores, whether kvsnap
takes the model at all (a plain full-attention decoder cache), and how far its RoPE keeps the KV fixed."""

from __future__ import annotations

import inspect

import torch

from kvsnap.errors import ConfigError, UnsupportedModelError
from kvsnap.types import KVLayout

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def forward_cache_kwarg(model: torch.nn.Module) -> str:
    """Name of the forward argument that takes the cache: ``cache`` (5.2x) or ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def check_supported(config) -> None:
    """Refuse models whose cache is not a plain full-attention ``DynamicCache``."""
    model_type = getattr(config, "model_type", "?")
    if getattr(config, "plain", False):
        return  # kvsnap.models.native_config.plain_config takes full-attention decoders only
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"model type {model_type!r} is an encoder-decoder model; kvsnap needs a decoder")
    try:
        cache = DynamicCache(config=config)
    except Exception as exc:
        raise UnsupportedModelError(f"model type {model_type!r}: cannot build its cache ({exc})") from None
    kinds = {type(layer).__name__ for layer in cache.layers}
    if not cache.layers or kinds != {DynamicLayer.__name__}:
        raise UnsupportedModelError(
            f"model type {model_type!r} uses a {'/'.join(sorted(kinds)) or 'custom'} cache (sliding-window, hybrid "
            "or recurrent); kvsnap supports full-attention decoders (Llama, Mistral, Qwen2/3, Phi-3, OLMo, Granite)"
        )


def layout_of(config, dtype: torch.dtype) -> KVLayout:
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return KVLayout(text.num_hidden_layers, kv_heads, head_dim, DTYPE_NAMES[dtype])


def rope_window(config) -> int | None:
    """The longest sequence whose RoPE frequencies are fixed, for a RoPE that switches them by the sequence
    length (longrope, dynamic NTK); None for a RoPE whose frequencies never change."""
    found = _rope_switch(config)
    return found[1] if found is not None else None


def check_rope_window(ctx_size: int, config) -> None:
    """Refuse a context that would cross the length where the model's RoPE switches frequencies (a size
    that is no positive number is left to ``limits.check_ctx_size``)."""
    found = _rope_switch(config)
    if found is not None and isinstance(ctx_size, int) and ctx_size > found[1]:
        kind, window = found
        raise ConfigError(
            f"the model's {kind} RoPE switches frequencies past {window:,} tokens, which would change the KV of "
            f"every earlier token; kvsnap runs it up to {window:,} tokens (--ctx-size {window} or less)"
        )


def _rope_switch(config) -> tuple[str, int] | None:
    """``(rope type, window)`` for a RoPE whose frequencies depend on the sequence length.

    transformers (``dynamic_rope_update``) picks a forward's frequencies from its longest position:
    longrope takes its long factors once that passes ``original_max_position_embeddings``, dynamic NTK
    rescales its base once it passes ``max_position_embeddings``. The new frequencies apply to the
    tokens of that forward only, so KV computed before the switch no longer matches what one forward
    over the whole sequence computes: a cache is exact only while every forward stays within the window.
    """
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    if not isinstance(rope, dict):
        return None
    # transformers 5 nests the parameters by layer type where layers differ: the shortest window holds.
    nested = [v for v in rope.values() if isinstance(v, dict)]
    found = [s for s in (_switch_of(p, text) for p in nested or [rope]) if s is not None]
    return min(found, key=lambda s: s[1]) if found else None


def _switch_of(rope: dict, text) -> tuple[str, int] | None:
    kind = rope.get("rope_type", rope.get("type"))
    if not isinstance(kind, str):
        return None
    if kind in ("longrope", "su"):  # "su": longrope's name in early Phi-3 configs
        # A top-level original_max_position_embeddings wins over the RoPE dict's, as in transformers (Phi-3).
        kind = "longrope"
        window = (
            getattr(text, "original_max_position_embeddings", None)
            or rope.get("original_max_position_embeddings")
            or getattr(text, "max_position_embeddings", None)
        )
    elif "dynamic" in kind:  # transformers rescales any type that names "dynamic"
        window = getattr(text, "max_position_embeddings", None)
    else:
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise UnsupportedModelError(f"the model's {kind} RoPE states no length where its frequencies switch")
    return kind, window
