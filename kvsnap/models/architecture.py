"""What a model's config says about its KV cache: the layout kvsnap keys and stores, and whether kvsnap
takes the model at all (a plain full-attention decoder cache)."""

from __future__ import annotations

import inspect

import torch

from kvsnap.errors import UnsupportedModelError
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
