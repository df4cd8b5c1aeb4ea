"""Tiny random-weight models for the engine tests: built offline, seeded, loadable by ``kvsnap.load_model``.

Each model is a real transformers architecture (Llama, Qwen2, Mistral, Phi-3, OLMo2, Granite, and the
sliding-window ones: Mistral, Qwen2 and Phi-3 with a window, Gemma 2, Gemma 3) shrunk to 2 layers,
hidden 64, 4 query heads over 2 KV heads (GQA), saved with ``save_pretrained`` next to a small
byte-level BPE tokenizer trained on an in-memory corpus and given a ChatML-like chat template.
Nothing is downloaded. The same architecture, seed and corpus give the same files (and so the same fingerprint).
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:  # the suite runs from a plain checkout, kvsnap need not be installed
    sys.path.insert(0, _ROOT)

VOCAB_SIZE = 320
BOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (BOS, IM_START, IM_END)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen 2.5's tool-calling template (Hermes style), kept close to the original so that the tests
# render tools, tool calls and tool results the way a real tool-calling model's template does.
TOOL_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments " }}
    {{- "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n" }}
    {{- "{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
        or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
CORPUS = (
    "The quick brown fox jumps over the lazy dog. ",
    "What is the capital of France? The capital of France is Paris. ",
    "And of Italy? The capital of Italy is Rome. ",
    "Once upon a time there was a small cache that kept every key and value it had ever seen. ",
    "Blocks of tokens are hashed in a chain, so a prefix is found by its last block alone. ",
    "user assistant system hello world how are you today 0123456789 ",
)

# transformers config class and the extra settings each architecture needs to be a plain full-attention model.
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {"use_sliding_window": False}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "phi3": ("Phi3Config", {"sliding_window": None}),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", {}),
}
CORE_ARCHS = ("llama", "qwen2", "mistral", "phi3")  # the four the brief requires; olmo2/granite are extra

# Sliding-window families, with windows far shorter than the test prompts. The Gemmas' attention scale
# (query_pre_attn_scalar) differs from head_dim ** -0.5 and Gemma 2's soft caps are low, so an attention
# that ignored the scale or the cap would move the logits well past the tests' tolerances.
_GEMMA = {"head_dim": 16, "query_pre_attn_scalar": 24}
SLIDING: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral-sliding": ("MistralConfig", {"sliding_window": 16}),
    "qwen2-sliding": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1}),
    "phi3-sliding": ("Phi3Config", {"sliding_window": 16}),
    "gemma2": (
        "Gemma2Config",
        {**_GEMMA, "sliding_window": 16, "attn_logit_softcapping": 4.0, "final_logit_softcapping": 8.0},
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {**_GEMMA, "sliding_window": 12, "layer_types": ["sliding_attention", "full_attention"]},
    ),
}

# RoPE whose frequencies transformers switches by the longest position in a forward, with a small window
# so a test crosses it in a few dozen tokens. Phi-3 longrope: short factors up to 64 positions, long ones
# past it (one factor per rotary frequency: head dim 16 -> 8). Llama dynamic NTK: rescaled past 64.
SWITCHING_ROPE: dict[str, tuple[str, dict[str, Any]]] = {
    "phi3-longrope": (
        "Phi3Config",
        {
            "sliding_window": None,
            "max_position_embeddings": 256,
            "original_max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.0, 1.1, 1.2, 1.4, 1.7, 2.0, 2.5],
                "long_factor": [1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0],
            },
        },
    ),
    "llama-dynamic": (
        "LlamaConfig",
        {
            "max_position_embeddings": 64,
            "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
        },
    ),
}

# Configs kvsnap cannot resume exactly: load_model must refuse them, in one line naming the reason.
UNSUPPORTED: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma2-no-window": ("Gemma2Config", {**_GEMMA, "sliding_window": None}),
    "gemma3-bidirectional": ("Gemma3TextConfig", {**_GEMMA, "sliding_window": 12, "use_bidirectional_attention": True}),
    "cohere2": ("Cohere2Config", {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]}),
}
ALL_ARCHS = {**ARCHS, **SLIDING, **UNSUPPORTED, **SWITCHING_ROPE}
# An architecture's weight seed is its index here: new ones go at the end, so that adding one never
# changes the weights (and outputs) of the models other tests already use.
SEED_ORDER = ("gemma2", "granite", "llama", "mistral", "mistral-sliding", "olmo2", "phi3", "qwen2")
SEED_ORDER += tuple(sorted(set(ALL_ARCHS) - set(SEED_ORDER)))


def build_tokenizer():
    """A byte-level BPE (any text encodes) with ChatML specials, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(CORPUS) * 4, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=IM_END, pad_token=BOS)
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def tiny_config(arch: str, tokenizer, **overrides: Any):
    """A ~2-layer, 64-wide config of ``arch`` (a key of ALL_ARCHS) sized to ``tokenizer``."""
    import transformers

    class_name, extra = ALL_ARCHS[arch]
    settings: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        # Larger than the usual 0.02 so attention is far from uniform: a wrong position or a wrong
        # KV entry moves the logits by much more than the tolerances the tests use.
        "initializer_range": 0.25,
        "bos_token_id": tokenizer.convert_tokens_to_ids(BOS),
        "eos_token_id": tokenizer.convert_tokens_to_ids(IM_END),
        "pad_token_id": tokenizer.convert_tokens_to_ids(BOS),
        **extra,
        **overrides,
    }
    return getattr(transformers, class_name)(**settings)


def build_tiny_model(folder: Path, arch: str, *, seed: int | None = None, **config_overrides: Any) -> Path:
    """Write a seeded random-weight model of ``arch`` and the tiny tokenizer into ``folder``.

    The default seed differs per architecture, so no two tiny models share weights.
    """
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    tokenizer = build_tokenizer()
    config = tiny_config(arch, tokenizer, **config_overrides)
    torch.manual_seed(seed if seed is not None else SEED_ORDER.index(arch))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def with_chat_template(src: Path, dst: Path, template: str) -> Path:
    """Copy a model folder with another chat template (same weights, so the same fingerprint)."""
    shutil.copytree(src, dst)
    config_path = dst / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config, indent=2))
    (dst / "chat_template.jinja").write_text(template)
    return dst


def perturbed_copy(src: Path, dst: Path, *, delta: float = 1e-3) -> Path:
    """Copy a model folder with one weight changed by ``delta`` (same config, tokenizer and shapes)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    tensors = load_file(str(weights))
    name = sorted(n for n in tensors if n.endswith("q_proj.weight") or n.endswith("qkv_proj.weight"))[0]
    tensors[name] = tensors[name].clone()
    tensors[name][0, 0] += delta
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return dst


# ---------------------------------------------------------------------------------------------
# Editing a written .kv (safetensors) file


def tensor_span(path: Path, name: str) -> tuple[int, int]:
    """Absolute ``[start, end)`` byte range of tensor ``name`` in a safetensors file."""
    data = path.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    start, end = header[name]["data_offsets"]
    return 8 + header_len + start, 8 + header_len + end


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))
