"""A plain-torch forward for the Llama family (Llama, Mistral without a sliding window, Qwen2), on the CPU.

Why: a new process spends most of its start importing transformers' modeling stack
(``modeling_utils``, ``masking_utils``, which pulls in ``torch._dynamo`` and sympy) and in
``from_pretrained``: ~3 s of a ~10 s ``kvsnap run --resume`` on a slow 2-core VM, for a forward
that is a few dozen lines. This module needs torch and safetensors only, maps the weights file
instead of building the model twice, and runs the same operations in the same order as
transformers' Llama with kvsnap's GQA attention, so its logits equal transformers' (bit for bit on
the default model; tests/test_native.py compares every architecture it takes).

It takes a model only when the config says nothing it does not implement
(``kvsnap.models.native_config``) and the weights file holds exactly its tensors; anything else
loads through transformers, as does any model on a GPU. ``KVSNAP_NATIVE=0`` turns it off. The
module names match transformers' (``model.layers.0.self_attn.q_proj``), so state dicts, hooks and
tests see the same model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvsnap.models import decode_step, packing, qstep
from kvsnap.models import exact as invariant
from kvsnap.models.native_config import FAMILY


@dataclass(frozen=True)
class _Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    vocab: int
    eps: float
    theta: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tied: bool

    @classmethod
    def of(cls, config: Any) -> _Shape:
        heads = config.num_attention_heads
        bias = FAMILY[config.model_type]
        if bias is None:  # Llama states its biases in the config
            bias = (bool(getattr(config, "attention_bias", False)),) * 2
        rope = getattr(config, "rope_parameters", None) or {}
        return cls(
            hidden=config.hidden_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate=config.intermediate_size,
            layers=config.num_hidden_layers,
            vocab=config.vocab_size,
            eps=config.rms_norm_eps,
            theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
            qkv_bias=bias[0],
            o_bias=bias[1],
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            tied=bool(getattr(config, "tie_word_embeddings", False)),
        )


def _param(*shape: int) -> nn.Parameter:
    # Uninitialised, on the meta device: the weights file fills it (``load``). No init function
    # runs (on the meta device those import torch._dynamo, 0.75 s).
    return nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)


class Linear(nn.Module):
    """``nn.Linear``'s parameters and forward, without its random initialisation."""

    plain_product = True  # x @ W.T + b and nothing more: kvsnap.models.quantize may replace it

    def __init__(self, inputs: int, outputs: int, bias: bool):
        super().__init__()
        self.weight = _param(outputs, inputs)
        self.bias = _param(outputs) if bias else None
        self.packed: torch.Tensor | None = None  # the weight in oneDNN's layout (kvsnap.models.packing)
        self.packed_of: packing.Source | None = None  # the weight it was made from
        self.packed_one_row = True  # whether a one-row product runs over it too (packing.ONE_ROW)

    def forward(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        packed, source = self.packed, self.packed_of
        if packed is not None and source is not None and not source.matches(self.weight):
            packed = self.packed = self.packed_of = None  # moved, cast (even back) or loaded since: stale, drop it
        # A one-row product runs over the packed weight where that measured faster; an exact forward's
        # products are never one row (kvsnap.models.exact pads them), so it runs one kernel for every cut.
        if not self.packed_one_row and not exact and x.numel() == x.shape[-1]:
            packed = None
        if packed is not None and source is not None and x.dtype == packed.dtype:
            if not exact:
                return packing.linear(x, packed, self.bias)
            return invariant.in_row_tiles(x, functools.partial(packing.linear, packed=packed, bias=self.bias))
        if not exact:
            return F.linear(x, self.weight, self.bias)
        return invariant.in_row_tiles(x, functools.partial(F.linear, weight=self.weight, bias=self.bias))


class Embedding(nn.Module):
    plain_lookup = True  # a table lookup and nothing more: kvsnap.models.quantize may replace it

    def __init__(self, count: int, size: int):
        super().__init__()
        self.weight = _param(count, size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = _param(size)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _inv_freq(s: _Shape) -> torch.Tensor:
    return 1.0 / (s.theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float) / s.head_dim))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, s: _Shape, index: int):
        super().__init__()
        self.index = index
        self.head_dim = s.head_dim
        self.groups = s.heads // s.kv_heads
        self.scaling = s.head_dim**-0.5
        self.q_proj = Linear(s.hidden, s.heads * s.head_dim, bias=s.qkv_bias)
        self.k_proj = Linear(s.hidden, s.kv_heads * s.head_dim, bias=s.qkv_bias)
        self.v_proj = Linear(s.hidden, s.kv_heads * s.head_dim, bias=s.qkv_bias)
        self.o_proj = Linear(s.heads * s.head_dim, s.hidden, bias=s.o_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask, cache) -> torch.Tensor:
        exact = isinstance(mask, invariant.Plan)
        shape = (*x.shape[:-1], -1, self.head_dim)
        q = self.q_proj(x, exact).view(shape).transpose(1, 2)
        k = self.k_proj(x, exact).view(shape).transpose(1, 2)
        v = self.v_proj(x, exact).view(shape).transpose(1, 2)
        q = (q * cos) + (_rotate_half(q) * sin)
        k = (k * cos) + (_rotate_half(k) * sin)
        if cache is not None:
            k, v = cache.update(k, v, self.index)
        if exact:
            return self.o_proj(invariant.attention(q, k, v, self.scaling, mask), exact=True)
        # One query over the cache, or a first chunk (causal, no mask): what transformers' SDPA path
        # runs; a later chunk: kvsnap's GQA attention's mask (kvsnap/engine/attention.py), made additive.
        causal = mask is None and q.shape[2] > 1
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=self.scaling, enable_gqa=self.groups > 1
        )
        out = out.transpose(1, 2).contiguous()
        return self.o_proj(out.reshape(*x.shape[:-1], -1).contiguous())


class MLP(nn.Module):
    def __init__(self, s: _Shape):
        super().__init__()
        self.gate_proj = Linear(s.hidden, s.intermediate, bias=s.mlp_bias)
        self.up_proj = Linear(s.hidden, s.intermediate, bias=s.mlp_bias)
        self.down_proj = Linear(s.intermediate, s.hidden, bias=s.mlp_bias)

    def forward(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        if exact:
            act = invariant.silu(self.gate_proj(x, exact=True)) * self.up_proj(x, exact=True)
            return self.down_proj(act, exact=True)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, s: _Shape, index: int):
        super().__init__()
        self.self_attn = Attention(s, index)
        self.mlp = MLP(s)
        self.input_layernorm = RMSNorm(s.hidden, s.eps)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps)

    def forward(self, x, cos, sin, mask, cache) -> torch.Tensor:
        if mask is decode_step.STEP:
            return decode_step.layer(self, x, cos, sin, cache)
        kernel = qstep.step_for(self, x, cache)  # a quantized layer on kvsnap's kernel, row by row
        if kernel is not None:
            return qstep.run(kernel, self.self_attn, x, cos, decode_step.signed_sin(sin), cache)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x), isinstance(mask, invariant.Plan))


class Decoder(nn.Module):
    def __init__(self, s: _Shape):
        super().__init__()
        self.embed_tokens = Embedding(s.vocab, s.hidden)
        self.layers = nn.ModuleList(DecoderLayer(s, i) for i in range(s.layers))
        self.norm = RMSNorm(s.hidden, s.eps)
        self.register_buffer("inv_freq", _inv_freq(s), persistent=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache, exact: bool = False) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        freqs = position_ids[..., None].float() * self.inv_freq.to(dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(x.dtype).unsqueeze(1)
        sin = emb.sin().to(x.dtype).unsqueeze(1)
        q_len = input_ids.shape[1]
        if q_len == 1 and cache is not None and not exact and input_ids.shape[0] == 1 and decode_step.ENABLED:
            return decode_step.hidden(self, x, cos, sin, cache)  # a decode step: the same layers, fewer calls
        past = cache.get_seq_length() if cache is not None else 0
        mask = None
        if exact:  # the attention's cut, for every layer (kvsnap.models.exact)
            mask = invariant.Plan.of(past, q_len, self.layers[0].self_attn.groups, input_ids.device)
        elif q_len > 1 and past:
            # Query i (position past + i) sees keys 0..past + i. Additive, made once here: SDPA turns a
            # bool mask into this very tensor in every layer (7% of a 32-token forward's attention at 4k).
            keys = torch.arange(past + q_len, device=input_ids.device)
            seen = keys[None, :] <= torch.arange(past, past + q_len, device=input_ids.device)[:, None]
            mask = torch.zeros(seen.shape, dtype=x.dtype, device=x.device).masked_fill_(~seen, float("-inf"))
            mask = mask[None, None]
        whole = qstep.run_layers(self, x, cos, decode_step.signed_sin(sin), cache) if cache is not None else None
        if whole is not None:  # every layer quantized on kvsnap's kernel, row by row: one call for all of them
            return self.norm(whole)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, cache)
        return self.norm(x)


@dataclass
class Output:
    logits: torch.Tensor


class NativeCausalLM(nn.Module):
    """A Llama-family causal LM: ``model(input_ids, position_ids=..., cache=..., logits_to_keep=...)``."""

    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        self.shape = _Shape.of(config)
        self.model = Decoder(self.shape)
        self.lm_head = Linear(self.shape.hidden, self.shape.vocab, bias=False)
        if self.shape.tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.packing: packing.Packing | None = None

    def packable_linears(self) -> list[Linear]:
        # The decoder's; the lm_head is packed too where the budget allows (kvsnap.models.packing).
        return [m for m in self.model.modules() if isinstance(m, Linear)]

    def start_packing(self) -> bool:
        """Pack the linear weights in the background (``kvsnap.models.packing``); forwards from now on wait
        for it and run over them. False where no packing was started (``packing.unsupported_reason``);
        a packing that fails leaves the model unpacked and says why in ``self.packing.error``."""
        with packing.STARTING:
            if self.packing is None and packing.unsupported_reason(self) is None:
                self.packing = packing.Packing(self)
        return self.packing is not None

    def get_input_embeddings(self) -> Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> Linear:
        return self.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cache=None,
        use_cache: bool = True,
        logits_to_keep: int = 0,
        exact: bool = False,
        **_: Any,
    ) -> Output:
        """``exact``: a batch-invariant forward (``kvsnap.models.exact``): a token's KV, and each row's
        logits, do not depend on how many tokens the forward runs."""
        if self.packing is not None:
            self.packing.wait()  # every forward after start_packing runs over the packed weights, or none
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(past, past + input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        hidden = self.model(input_ids, position_ids, cache if use_cache else None, exact)
        hidden = hidden[:, slice(-logits_to_keep, None), :]
        if exact:
            return Output(invariant.one_row_at_a_time(hidden, self.lm_head))
        return Output(self.lm_head(hidden))


class NotNative(Exception):
    """The folder's weights are not exactly this module's tensors: load it through transformers."""


def load(
    folder: Path, config: Any, dtype: torch.dtype, aliases: dict[str, str], quantizing: bool = False
) -> NativeCausalLM:
    """The model in ``folder`` with its weights mapped from its safetensors file(s).

    ``aliases`` ({dropped name: kept name}) are tensors a conversion stored once for two names.
    ``quantizing``: the matrices (linears, embedding) stay mapped in the file's dtype, for
    ``kvsnap.models.quantize`` to read one at a time: no cast copy of the whole model is ever made.
    Raises ``NotNative`` when the file's tensors are not exactly the ones this module has.
    """
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in _weight_files(folder):
        tensors.update(load_file(str(path)))
    for dropped, kept in aliases.items():
        if dropped not in tensors and kept in tensors:
            tensors[dropped] = tensors[kept]
    model = NativeCausalLM(config)
    expected = set(model.state_dict())
    if model.shape.tied:
        tensors.setdefault("lm_head.weight", tensors.get("model.embed_tokens.weight"))
        if tensors.get("lm_head.weight") is None:
            raise NotNative("no embedding")
    missing, unexpected = expected - tensors.keys(), tensors.keys() - expected
    if missing or unexpected:
        raise NotNative(f"missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}")
    state = model.state_dict()
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(state[name].shape):
            raise NotNative(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(state[name].shape)}")
    # Cast only what needs it (a float32 file into a float32 model is used as mapped).
    kept = {name for name, t in tensors.items() if t.dtype == dtype or (quantizing and t.dim() == 2)}
    cast = {name: t if name in kept else t.to(dtype) for name, t in tensors.items()}
    model.load_state_dict(cast, assign=True, strict=True)
    if model.shape.tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval().requires_grad_(False)


def _weight_files(folder: Path) -> list[Path]:
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    index = folder / "model.safetensors.index.json"
    from kvsnap.paths import json_object

    raw = json_object(index)
    weight_map = raw.get("weight_map") if raw is not None else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise NotNative("unreadable safetensors index")
    names = sorted(set(weight_map.values()))
    files = [folder / n for n in names]
    if not names or any(Path(n).name != n or not f.is_file() for n, f in zip(names, files)):
        raise NotNative("a shard outside the folder or missing")
    return files
