"""One decode step of the native forward: one token through every layer over the cache, in few operator calls.

Why: a one-token forward of a small model on a CPU is mostly overhead, not arithmetic. The default model's
30 layers took ~5,900 operator calls per decoded token (``torch.profiler``): casts that do nothing in
float32, the rotary half-rotation built from two slices, a negation and a cat, the attention's output
transposed and copied back, each a Python call into the dispatcher, and on a shared 2-core machine each
parallel region a chance to wait for a descheduled thread. Here the same layers run on a ``[1, hidden]``
row with:

- the norms as ``torch.rms_norm`` in float32 (one call; bit for bit the layer's formula there, which
  tests/test_decode_step.py checks); other dtypes keep the layer's own norm, which rounds differently;
- the rotation as ``x * cos + flip(x) * sin_signed``: the two halves of each head swapped by one ``flip``,
  and the sign of the first half moved onto ``sin`` (multiplying by -1 is exact, so the result is the
  layer's bit for bit);
- the attention of one query handed to SDPA as it is, its ``[1, heads, 1, head_dim]`` output already laid
  out as the ``[1, heads * head_dim]`` row the output projection takes.

The linears are the layers' own modules (``Linear`` picks the packed or the plain weight for a one-row
product: ``kvsnap.models.packing``), so hooks, packing and a weight changed since still behave as in
``forward``. Only the native forward's full-attention layers come here, never an exact (batch-invariant)
forward: that one computes a decode step as it computes a prefill row, on purpose. ``KVSNAP_DECODE_STEP=0``
turns it off (a one-token forward then runs ``forward``'s general path). Layers quantized on kvsnap's own
kernel take ``kvsnap.models.qstep`` instead (all of them in one call where no hook watches them).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

from kvsnap.models import qstep

ENABLED = os.environ.get("KVSNAP_DECODE_STEP", "1") != "0"


class Step:
    """The mask argument that tells a decoder layer it runs one decode step (``layer``)."""


STEP = Step()


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: ``rotate_half(x) * sin == flip_halves(x) * signed_sin(sin)``."""
    half = sin.shape[-1] // 2
    sign = torch.ones(sin.shape[-1], dtype=sin.dtype, device=sin.device)
    sign[:half] = -1
    return sin * sign


def rotate(x: torch.Tensor, heads: int, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE of one token's ``[1, heads * head_dim]`` projection, as ``[heads, head_dim]``."""
    x = x.view(heads, 2, -1)  # the two halves of each head
    return x.view(heads, -1) * cos + x.flip(1).view(heads, -1) * sin_signed


def norm(module: Any, x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float32:
        return torch.rms_norm(x, module.weight.shape, module.weight, module.eps)
    return module(x)


def layer(block: Any, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, cache: Any) -> torch.Tensor:
    """One decoder layer on one token. x: [1, hidden]."""
    attn = block.self_attn
    kernel_step = qstep.step_for(block, x, cache)  # every product on kvsnap's own kernel: two calls into it
    if kernel_step is not None:
        return qstep.run(kernel_step, attn, x, cos, sin_signed, cache)
    h = norm(block.input_layernorm, x)
    head_dim = attn.head_dim
    qkv = attn.__dict__.get("qkv")  # the three projections as one quantized product (kvsnap.models.fused)
    if qkv is not None:
        q_width, kv_width, _ = qkv.widths
        heads, kv_heads = q_width // head_dim, kv_width // head_dim
        both = qkv(h)  # [1, (heads + 2 * kv_heads) * head_dim]
        # q and k rotate as one [heads + kv_heads, head_dim] block: the rotation is per head.
        qk = rotate(both[:, : q_width + kv_width], heads + kv_heads, cos, sin_signed)
        q, k, v = qk[:heads], qk[heads:], both[:, q_width + kv_width :]
    else:
        q, k = attn.q_proj(h), attn.k_proj(h)  # [1, heads * head_dim], [1, kv_heads * head_dim]
        heads, kv_heads = q.shape[-1] // head_dim, k.shape[-1] // head_dim
        q = rotate(q, heads, cos, sin_signed)  # [heads, head_dim]
        k = rotate(k, kv_heads, cos, sin_signed)
        v = attn.v_proj(h)
    keys, values = cache.update(k.view(1, kv_heads, 1, head_dim), v.view(1, kv_heads, 1, head_dim), attn.index)
    out = F.scaled_dot_product_attention(
        q.view(1, heads, 1, head_dim), keys, values, scale=attn.scaling, enable_gqa=attn.groups > 1
    )  # [1, heads, 1, head_dim]: with one query, the memory order of [1, 1, heads * head_dim]
    x = x + attn.o_proj(out.reshape(1, heads * head_dim))
    mlp = block.mlp
    h = norm(block.post_attention_layernorm, x)
    gate_up = mlp.__dict__.get("gate_up")
    if gate_up is not None:
        gate, up = gate_up(h).chunk(2, dim=-1)
        return x + mlp.down_proj(F.silu(gate) * up)
    return x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))


def hidden(decoder: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any) -> torch.Tensor:
    """The decoder's final hidden state for one token. x: [1, 1, hidden] (embedded); cos, sin: [1, 1, 1, head_dim]."""
    cos, sin_signed = cos.view(-1), signed_sin(sin.view(-1))
    row = x.view(1, -1)
    whole = qstep.run_layers(decoder, row, cos, sin_signed, cache)  # quantized on kvsnap's kernel: one call
    if whole is not None:
        return norm(decoder.norm, whole).view(x.shape)
    for block in decoder.layers:
        # Called as a module, with STEP where the mask goes: the layer's forward comes back to
        # ``layer``, and hooks on the layer fire as in any forward.
        row = block(row, cos, sin_signed, STEP, cache)
    return norm(decoder.norm, row).view(x.shape)
