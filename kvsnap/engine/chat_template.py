"""Chat messages to token ids through the model's own chat template."""

from __future__ import annotations

from collections.abc import Sequence

from kvsnap.errors import ConfigError
from kvsnap.models.load import LoadedModel


def render_chat(lm: LoadedModel, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` in ``lm``'s chat template."""
    tok = lm.tokenizer
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"model {lm.name} has no chat template; give a raw prompt instead")
    text = tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)
    return list(tok(text, add_special_tokens=False)["input_ids"])
