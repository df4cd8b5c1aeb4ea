"""Chat messages to token ids through the model's own chat template.

Control tokens come from the template only: special-token text inside a message (``<|im_end|>``
typed by a user) stays text, so a message cannot close its own turn and forge another. A
conversation without such text tokenizes exactly as ``apply_chat_template`` + the tokenizer always
did (the same ids, so existing snapshots keep matching).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from kvsnap.errors import ConfigError
from kvsnap.models.load import LoadedModel


def _texts(messages: Sequence[dict[str, Any]]) -> list[str]:
    """Every string value of the messages (tool calls and other structured fields are not text)."""
    return [v for m in messages for v in m.values() if isinstance(v, str)]


def render_chat(
    lm: LoadedModel,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: Sequence[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of ``messages`` in ``lm``'s chat template; ``tools`` (OpenAI's function tools) go to
    the template's ``tools`` variable, as transformers' ``apply_chat_template`` passes them."""
    ids = _render(lm, messages, add_generation_prompt, cut=None, tools=tools)
    assert ids is not None
    return ids


def render_after(
    lm: LoadedModel,
    history: Sequence[dict[str, Any]],
    new: Sequence[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: Sequence[dict[str, Any]] | None = None,
) -> list[int] | None:
    """Token ids the template writes after the content of ``history``'s last message once ``new``
    follows it: that message's closing, the new messages and the generation prompt. The earlier
    messages are not tokenized (their ids are the ones already run). None when the template does not
    render that content as it is (nothing to cut the rendering at)."""
    if not history or not isinstance(history[-1].get("content"), str):
        return None
    used = {c for v in _texts([*history, *new]) for c in v if "\ue000" <= c < "\uf900"}
    cut = next((chr(c) for c in range(0xF8FF, 0xE000, -1) if chr(c) not in used), None)
    if cut is None:
        return None
    marked = [*history[:-1], {**history[-1], "content": cut}, *new]
    return _render(lm, marked, add_generation_prompt, cut=cut, tools=tools)


def continue_ids(
    lm: LoadedModel, ran_ids: Sequence[int], history: Sequence[dict[str, str]], new: Sequence[dict[str, str]]
) -> list[int] | None:
    """``ran_ids`` (``history`` as the model ran it, ending with its last message's content) with ``new``
    and the generation prompt appended as the template writes them after ``history``; None when the
    template gives no place to cut (then render the whole conversation)."""
    tail = render_after(lm, history, new)
    if not tail or not ran_ids:
        return None
    # An answer that ended on its end-of-turn token: the template's closing starts with that token again.
    if ran_ids[-1] in lm.eos_token_ids and tail[0] == ran_ids[-1]:
        tail = tail[1:]
    return [*ran_ids, *tail]


def _render(
    lm: LoadedModel,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool,
    cut: str | None,
    tools: Sequence[dict[str, Any]] | None = None,
) -> list[int] | None:
    """Render and tokenize; with ``cut``, only the text after that character (None when it is missing)."""
    tok = lm.tokenizer
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"model {lm.name} has no chat template; give a raw prompt instead")
    specials = special_texts(tok)
    found = sorted({s for v in _texts(messages) for s in specials if s in v}, key=len, reverse=True)
    extra: dict[str, Any] = {"tools": list(tools)} if tools else {}
    # Tool schemas and past calls are rendered by the template as JSON it builds: no stand-in can
    # reach inside them, so special-token text there is refused rather than left to forge a turn.
    nested = json.dumps(
        [[v for v in m.values() if not isinstance(v, str)] for m in messages] + [extra], ensure_ascii=False
    )
    if any(s in nested for s in specials):
        raise ConfigError("a tool's schema or a tool call holds special-token text, which cannot be kept as text")
    if not found:
        text = tok.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **extra
        )
        text = _after(text, cut)
        return None if text is None else list(tok(text, add_special_tokens=False)["input_ids"])
    return _render_literal(tok, messages, found, specials, add_generation_prompt, extra, cut)


def _after(text: str, cut: str | None) -> str | None:
    if cut is None:
        return text
    at = text.find(cut)
    return text[at + len(cut) :] if at >= 0 and text.count(cut) == 1 else None


def special_texts(tok) -> set[str]:
    """The text of every special token the tokenizer turns into a control id when it meets it."""
    added = getattr(tok, "added_tokens_decoder", {}) or {}
    texts = {t.content for t in added.values() if getattr(t, "special", False)}
    return {t for t in texts | set(getattr(tok, "all_special_tokens", ())) if t}


def _render_literal(
    tok,
    messages: Sequence[dict[str, Any]],
    found: list[str],
    specials: set[str],
    add_generation_prompt: bool,
    extra: dict[str, Any],
    cut: str | None = None,
) -> list[int] | None:
    """Render with each special-token text in the messages replaced by a stand-in, so every control
    token of the result is the template's; tokenize that, then re-tokenize only the stretches between
    control tokens that hold a stand-in, from the real text, with special-token text kept as text."""
    used = {c for v in _texts(messages) for c in v if "\ue000" <= c < "\uf900"}
    mark = next((chr(c) for c in range(0xE000, 0xF900) if chr(c) not in used and chr(c) != cut), None)
    if mark is None:
        raise ConfigError("a message holds special-token text and every private-use character: cannot keep it text")
    pattern = re.compile("|".join(map(re.escape, found)))
    index = {s: i for i, s in enumerate(found)}
    masked = [
        {
            k: pattern.sub(lambda x: f"{mark}{index[x.group()]}{mark}", v) if isinstance(v, str) else v
            for k, v in m.items()
        }
        for m in messages
    ]
    text = _after(
        tok.apply_chat_template(masked, tokenize=False, add_generation_prompt=add_generation_prompt, **extra), cut
    )
    if text is None:
        return None
    try:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, ValueError, TypeError):
        raise ConfigError(
            f"a message holds special-token text ({found[0]}) that this tokenizer cannot keep as plain text"
        ) from None
    control = {i for i in tok.convert_tokens_to_ids(sorted(specials)) if isinstance(i, int)}
    unmask = re.compile(f"{mark}(\\d+){mark}")
    out: list[int] = []
    run: list[int] = []
    start = 0  # where the text between the previous control token and the next one begins

    def close(end: int) -> None:
        piece = text[start:end]
        if mark not in piece:
            out.extend(run)  # ids exactly as the plain path gives them
            return
        real = unmask.sub(lambda x: found[int(x.group(1))], piece)
        out.extend(tok(real, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    for token, (a, b) in zip(enc["input_ids"], enc["offset_mapping"]):
        if token in control:
            close(a)
            out.append(token)
            run, start = [], b
        else:
            run.append(token)
    close(len(text))
    return out
