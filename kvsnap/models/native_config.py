"""Which models the native forward (``kvsnap.models.native``) takes, decided from their config. No torch here.

``plain_config`` reads a config.json without transformers' config classes; ``unsupported_reason``
says why a config (plain or transformers') is one the native forward does not implement.
"""

from __future__ import annotations

import os
from typing import Any

# model_type -> (bias on q/k/v, bias on o_proj); everything else about these three is Llama's.
FAMILY = {"llama": None, "mistral": (False, False), "qwen2": (True, False)}


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
    and sympy, a large part of a new process's start, to read a dozen numbers. ``plain_config`` makes
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
    if model_type not in FAMILY or any(key not in raw for key in _STATED):
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
    """False when ``KVSNAP_NATIVE=0`` asks for transformers' classes throughout."""
    return os.environ.get("KVSNAP_NATIVE", "1") != "0"


def unsupported_reason(config: Any, device: Any) -> str | None:
    """Why the native forward cannot run ``config``'s model (on ``device``, a torch.device) exactly as
    transformers would (None: it can)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILY:
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
