"""A plain-torch forward for the Llama family (Llama, Mistral without a sliding window, Qwen2), on the CPU.

Why: a new process spends most of its start importing transformers' modeling stack
(``modeling_utils``, ``masking_utils``, which pulls in ``torch._dynamo`` and sympy) and in
``from_pretrained``: ~3 s of a ~10 s ``kvsnap run --resume`` on a slow 2-core VM, for a forward
that is a few dozen lines. This module needs torch and safetensors only, maps the weights file
instead of building the model twice, and runs the same operations in the same order as
transformers' Llama with kvsnap's GQA attention, so its logits equal transformers' (bit for bit on
the default model; tests/test_native.py compares every architecture it takes).

It takes a model only when the config says nothing it does not implement (``unsupported_reason``)
and the weights file holds exactly its tensors; anything else loads through transformers, as does
any model on a GPU. ``KVSNAP_NATIVE=0`` turns it off. The module names match transformers'
(``model.layers.0.self_attn.q_proj``), so state dicts, hooks and tests see the same model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# model_type -> (bias on q/k/v, bias on o_proj); everything else about these three is Llama's.
_FAMILY = {"llama": None, "mistral": (False, False), "qwen2": (True, False)}


# Keys the forward reads whose defaults differ between the families' transformers config classes:
# a config.json that leaves one out is read by transformers.
_STATED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
)


class PlainConfig:
    """A Llama-family ``config.json`` as attributes, read without transformers' config classes.

    Why: importing those (``PreTrainedConfig`` and its validators) pulls in ``torch.distributed.tensor``
    and sympy, ~1.5 s of a new process on a slow CPU, to read a dozen numbers. ``plain_config`` makes
    one only for a config whose every value the native forward reads is written out (or has the one
    default all three families share) and describes a plain full-attention model; any other
    config.json is read by transformers. It offers what kvsnap reads of a config: attributes,
    ``get_text_config()`` and ``to_dict()``.
    """

    plain = True
    is_encoder_decoder = False

    def __init__(self, raw: dict[str, Any], theta: float):
        self.__dict__.update(raw)
        heads = raw["num_attention_heads"]
        self.head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        self.rope_parameters = {"rope_theta": theta, "rope_type": "default"}
        self.hidden_act = raw.get("hidden_act", "silu")
        self.attention_bias = bool(raw.get("attention_bias", False))
        self.mlp_bias = bool(raw.get("mlp_bias", False))
        self.sliding_window = None
        self.layer_types = None

    def get_text_config(self, decoder: bool = True) -> PlainConfig:
        return self

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def plain_config(raw: dict[str, Any]) -> PlainConfig | None:
    """``raw`` (a config.json) as a ``PlainConfig``, or None when transformers must read it."""

    def count(key: str) -> bool:
        value = raw.get(key)
        return isinstance(value, int) and not isinstance(value, bool) and value > 0

    model_type = raw.get("model_type")
    if model_type not in _FAMILY or any(key not in raw for key in _STATED):
        return None
    if not all(count(k) for k in _STATED[:6] + ("max_position_embeddings",)):
        return None
    if raw["hidden_size"] % raw["num_attention_heads"] or raw["num_attention_heads"] % raw["num_key_value_heads"]:
        return None
    if raw.get("head_dim") is not None and not count("head_dim"):
        return None
    eps = raw["rms_norm_eps"]
    if not isinstance(eps, float | int) or isinstance(eps, bool) or not isinstance(raw["tie_word_embeddings"], bool):
        return None
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type", "default")) != "default":
        return None
    theta = rope.get("rope_theta", raw.get("rope_theta"))
    if not isinstance(theta, float | int) or isinstance(theta, bool) or theta <= 0:
        return None
    if raw.get("hidden_act", "silu") != "silu" or raw.get("pretraining_tp", 1) != 1:
        return None
    if any(key in raw for key in ("quantization_config", "auto_map", "attention_chunk_size")):
        return None
    layer_types = raw.get("layer_types")
    if layer_types is not None and layer_types != ["full_attention"] * raw["num_hidden_layers"]:
        return None
    # Mistral's class defaults to a 4k sliding window; Qwen2 has one only when use_sliding_window is set.
    if model_type == "mistral" and ("sliding_window" not in raw or raw["sliding_window"] is not None):
        return None
    if model_type == "qwen2" and raw.get("use_sliding_window", False) is not False:
        return None
    if model_type == "llama" and raw.get("sliding_window") is not None:
        return None
    return PlainConfig(raw, float(theta))


def enabled() -> bool:
    return os.environ.get("KVSNAP_NATIVE", "1") != "0"


def unsupported_reason(config: Any, device: torch.device) -> str | None:
    """Why this module cannot run ``config``'s model exactly as transformers would (None: it can)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in _FAMILY:
        return f"model type {model_type!r}"
    if device.type != "cpu":
        return f"device {device.type}"  # transformers' stock SDPA path is the one measured on GPUs
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        return f"RoPE type {rope.get('rope_type')!r}"
    sliding = getattr(config, "sliding_window", None)
    if sliding and (model_type != "qwen2" or getattr(config, "use_sliding_window", False)):
        return "a sliding window"
    layer_types = getattr(config, "layer_types", None)
    if layer_types and set(layer_types) != {"full_attention"}:
        return "layer types other than full attention"
    if getattr(config, "pretraining_tp", 1) not in (1, None):
        return "pretraining_tp"
    if getattr(config, "tie_word_embeddings", False) is None:
        return "tie_word_embeddings unset"
    return None


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
        bias = _FAMILY[config.model_type]
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

    def __init__(self, inputs: int, outputs: int, bias: bool):
        super().__init__()
        self.weight = _param(outputs, inputs)
        self.bias = _param(outputs) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
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
        shape = (*x.shape[:-1], -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        q = (q * cos) + (_rotate_half(q) * sin)
        k = (k * cos) + (_rotate_half(k) * sin)
        if cache is not None:
            k, v = cache.update(k, v, self.index)
        # One query over the cache, or a first chunk (causal, no mask): what transformers' SDPA path
        # runs; a later chunk: the bool mask kvsnap's GQA attention runs (kvsnap/engine/attention.py).
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, s: _Shape, index: int):
        super().__init__()
        self.self_attn = Attention(s, index)
        self.mlp = MLP(s)
        self.input_layernorm = RMSNorm(s.hidden, s.eps)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps)

    def forward(self, x, cos, sin, mask, cache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, s: _Shape):
        super().__init__()
        self.embed_tokens = Embedding(s.vocab, s.hidden)
        self.layers = nn.ModuleList(DecoderLayer(s, i) for i in range(s.layers))
        self.norm = RMSNorm(s.hidden, s.eps)
        self.register_buffer("inv_freq", _inv_freq(s), persistent=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        freqs = position_ids[..., None].float() * self.inv_freq.to(dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(x.dtype).unsqueeze(1)
        sin = emb.sin().to(x.dtype).unsqueeze(1)
        q_len = input_ids.shape[1]
        past = cache.get_seq_length() if cache is not None else 0
        mask = None
        if q_len > 1 and past:
            # Query i (position past + i) sees keys 0..past + i.
            keys = torch.arange(past + q_len, device=input_ids.device)
            mask = (keys[None, :] <= torch.arange(past, past + q_len, device=input_ids.device)[:, None])[None, None]
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
        **_: Any,
    ) -> Output:
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(past, past + input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        hidden = self.model(input_ids, position_ids, cache if use_cache else None)
        return Output(self.lm_head(hidden[:, slice(-logits_to_keep, None), :]))


class NotNative(Exception):
    """The folder's weights are not exactly this module's tensors: load it through transformers."""


def load(folder: Path, config: Any, dtype: torch.dtype, aliases: dict[str, str]) -> NativeCausalLM:
    """The model in ``folder`` with its weights mapped from its safetensors file(s).

    ``aliases`` ({dropped name: kept name}) are tensors a conversion stored once for two names.
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
    cast = {name: t if t.dtype == dtype else t.to(dtype) for name, t in tensors.items()}
    model.load_state_dict(cast, assign=True, strict=True)
    if model.shape.tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval().requires_grad_(False)


def _weight_files(folder: Path) -> list[Path]:
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    index = folder / "model.safetensors.index.json"
    from kvsnap.models.load import json_object

    raw = json_object(index)
    weight_map = raw.get("weight_map") if raw is not None else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise NotNative("unreadable safetensors index")
    names = sorted(set(weight_map.values()))
    files = [folder / n for n in names]
    if not names or any(Path(n).name != n or not f.is_file() for n, f in zip(names, files)):
        raise NotNative("a shard outside the folder or missing")
    return files
