"""What a model folder says about generation: its end-of-sequence ids, end-of-turn tokens and sampling settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvsnap.paths import json_object


def generation_eos(folder: Path) -> list[int]:
    """The end-of-sequence ids generation_config.json names (transformers' models read it as their
    ``generation_config``; the native one reads it here)."""
    raw = json_object(folder / "generation_config.json")
    value = raw.get("eos_token_id") if raw is not None else None
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


# Tokens chat templates close a turn with. A model whose config names only its end-of-text token
# (Qwen's <|endoftext|>) would otherwise answer past its own turn, writing the next user message.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endofturn|>")


def end_of_turn_ids(tokenizer: Any) -> set[int]:
    """Ids of the end-of-turn tokens the tokenizer's chat template uses."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return set()
    ids = set()
    for text in _END_OF_TURN:
        if text in template:
            token_id = tokenizer.convert_tokens_to_ids(text)
            if isinstance(token_id, int) and token_id != getattr(tokenizer, "unk_token_id", None):
                ids.add(token_id)
    return ids


def sampling_defaults_of(folder: Path) -> dict[str, float | int]:
    """The sampling settings a model's authors recommend, as written in its generation_config.json.

    Read from the file, not from transformers' GenerationConfig, whose class defaults (temperature
    1.0, top_k 50) would pass for recommendations. ``do_sample: false`` means greedy.
    """
    raw = json_object(folder / "generation_config.json")
    if raw is None:
        return {}
    if raw.get("do_sample") is False:
        return {"temperature": 0.0}
    found: dict[str, float | int] = {}
    for key, kind in (("temperature", float), ("top_p", float), ("top_k", int)):
        value = raw.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            found[key] = kind(value)
    return found
