"""What a model's config says about its KV cache: the layout kvsnap keys and stores, whether kvsnap
takes the model at all (a decoder cache of full-attention and sliding-window layers), and how far
its RoPE keeps the KV fixed."""

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


# Families whose sliding-window layers kvsnap runs and resumes exactly (tests/test_sliding_window.py covers
# each): the window is a mask on absolute positions over a cache that keeps every position. Another
# family with sliding layers may put more into its attention (sinks, chunks, relative biases) than a
# window, so it is refused until a test says it resumes exactly.
SLIDING_FAMILIES = {
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "phi3": "Phi-3",
    "gemma2": "Gemma 2",
    "gemma3_text": "Gemma 3 (text)",
}


def check_supported(config) -> None:
    """Refuse models whose cache is not a decoder cache of full-attention and sliding-window layers
    (the latter for ``SLIDING_FAMILIES``)."""
    model_type = getattr(config, "model_type", "?")
    if getattr(config, "plain", False):
        return  # kvsnap.models.native_config.plain_config takes full-attention decoders only
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"model type {model_type!r} is an encoder-decoder model; kvsnap needs a decoder")
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    _check_attention_pattern(text, model_type)
    try:
        cache = DynamicCache(config=config)
    except Exception as exc:
        raise UnsupportedModelError(f"model type {model_type!r}: cannot build its cache ({exc})") from None
    kinds = {type(layer).__name__ for layer in cache.layers}
    if not cache.layers or not kinds <= {DynamicLayer.__name__, DynamicSlidingWindowLayer.__name__}:
        raise UnsupportedModelError(
            f"model type {model_type!r} uses a {'/'.join(sorted(kinds)) or 'custom'} cache (hybrid or recurrent); "
            "kvsnap supports decoders with full-attention and sliding-window layers"
        )
    if DynamicSlidingWindowLayer.__name__ in kinds and model_type not in SLIDING_FAMILIES:
        if getattr(text, "model_type", None) in SLIDING_FAMILIES:  # Gemma 3 4B and up: text and vision
            raise UnsupportedModelError(
                f"model type {model_type!r} is a vision-language model; kvsnap runs text models, such as its "
                f"text-only form {text.model_type!r}"
            )
        raise UnsupportedModelError(
            f"model type {model_type!r} has sliding-window layers, and kvsnap resumes sliding windows exactly only "
            f"for {', '.join(SLIDING_FAMILIES.values())}"
        )


def _check_attention_pattern(text, model_type: str) -> None:
    """Refuse what a prefix's KV cannot be reused under: attention that sees later tokens, chunks, or a
    sliding layer without a window."""
    if getattr(text, "use_bidirectional_attention", False) or getattr(text, "is_causal", True) is False:
        raise UnsupportedModelError(
            f"model type {model_type!r} is set to bidirectional attention: a position's KV depends on the tokens "
            "after it, so no prefix can be reused"
        )
    layer_types = getattr(text, "layer_types", None) or []
    if "chunked_attention" in layer_types or getattr(text, "attention_chunk_size", None) is not None:
        raise UnsupportedModelError(f"model type {model_type!r} uses chunked attention, which kvsnap does not run")
    if "sliding_attention" in layer_types and getattr(text, "sliding_window", None) is None:
        raise UnsupportedModelError(
            f"model type {model_type!r} has sliding-window layers but its config sets no sliding_window "
            "(transformers cannot run it either)"
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
