"""A GQA-aware attention function for transformers, registered as ``kvsnap_sdpa``.

Stock ``sdpa`` in transformers expands the KV heads to the query heads (``repeat_kv``) whenever
an attention mask is present, i.e. on every prefill over a cache: for a 32-token suffix over a
4k cache on CPU that copy costs as much as the attention itself. torch's SDPA computes grouped
attention directly with ``enable_gqa=True`` (same result, no copy). It is used for cold and
resumed runs alike, so comparisons stay fair; on CUDA the stock path is kept, since masked GQA
there can fall back to the slow math kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "kvsnap_sdpa"
_registered = False


def gqa_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, Hq, S, D]
    key: torch.Tensor,  # [B, Hkv, T, D]
    value: torch.Tensor,  # [B, Hkv, T, D]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    special = dropout or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
    if attention_mask is None or groups == 1 or special or module.training:
        # Nothing to gain (no mask means transformers already uses GQA or packs it), or a feature we leave to it.
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None  # [B, S, Hq, D]


def register() -> str:
    """Register the function (and the sdpa mask format) under ``NAME``; returns the name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(NAME, gqa_sdpa_forward)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _registered = True
    return NAME


def implementation_for(device: torch.device, model_class: type | None = None) -> str:
    """kvsnap's function on the CPU, transformers' sdpa elsewhere; ``eager`` for a model class that
    cannot take SDPA (Gemma 2: its attention logits are soft-capped, which SDPA cannot do), as
    transformers itself would choose."""
    if model_class is not None and not getattr(model_class, "_supports_sdpa", True):
        return "eager"
    return register() if device.type == "cpu" else "sdpa"
