"""Chat messages to token ids through the model's own chat template.

Control tokens come from the template only: special-token text inside a message (``<|im_end|>``
typed by a user) stays text, so a message cannot close its own turn and forge another. A
conversation without such text tokenizes exactly as ``apply_chat_template`` + the tokenizer always
did (the same ids, so existing snapshots keep matching).
"""

from __future__ import annotations

import contextlib
import json
import re
import weakref
from collections.abc import Sequence
from typing import Any

from kvsnap import limits
from kvsnap.errors import ChatTemplateError, ConfigError, ContextFullError, KvsnapError
from kvsnap.models import chat_jinja
from kvsnap.models.load import LoadedModel
from kvsnap.models.plain_tokenizer import longest_token_bytes
from kvsnap.models.template_bounds import MAX_CHARS, Bounds, RenderLimit, template_line


def _texts(messages: Sequence[dict[str, Any]]) -> list[str]:
    """Every string value of the messages (tool calls and other structured fields are not text)."""
    return [v for m in messages for v in m.values() if isinstance(v, str)]


def render_chat(
    lm: LoadedModel,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: Sequence[dict[str, Any]] | None = None,
    fit_chars: int | None = None,
) -> list[int]:
    """Token ids of ``messages`` in ``lm``'s chat template; ``tools`` (OpenAI's function tools) go to
    the template's ``tools`` variable, as transformers' ``apply_chat_template`` passes them.
    ``fit_chars``: a rendering longer than that cannot fit the context, and stops there with
    ``ContextFullError`` (before it is tokenized). A template that fails, or goes past the bounds of
    a rendering (``kvsnap.models.chat_jinja``), is a one-line ``ChatTemplateError``."""
    ids = _render(lm, messages, add_generation_prompt, cut=None, tools=tools, fit_chars=fit_chars)
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
    fit_chars: int | None = None,
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
        text = _apply(lm, list(messages), add_generation_prompt, extra, fit_chars)
        text = _after(text, cut)
        return None if text is None else list(tok(text, add_special_tokens=False)["input_ids"])
    return _render_literal(lm, messages, found, specials, add_generation_prompt, extra, cut, fit_chars)


def _bounds(lm: LoadedModel, messages: Sequence[dict[str, Any]], extra: dict[str, Any]) -> Bounds:
    """A rendering's bounds: the text the context can hold (in characters: a character is at least a
    byte) plus twice what the chat brings, so a conversation longer than the context still renders
    (to be cut to fit) and a template that makes far more than it is given stops."""
    room = _room(lm)
    given = sum(map(len, _texts(messages))) + len(json.dumps(extra, ensure_ascii=False))
    return Bounds(max_chars=room + 2 * given)


_ROOMS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def _room(lm: LoadedModel) -> int:
    """The characters of text the context can hold at most (the vocabulary is read once per tokenizer)."""
    context, _ = limits.token_limit(lm.max_positions, lm.context_source)
    try:
        per_token = _ROOMS[lm.tokenizer]
    except (KeyError, TypeError):
        per_token = longest_token_bytes(lm.tokenizer) or 0
        with contextlib.suppress(TypeError):  # one that cannot be weakly referenced: read again next time
            _ROOMS[lm.tokenizer] = per_token
    return context * per_token if per_token else MAX_CHARS


def _apply(
    lm: LoadedModel,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    extra: dict[str, Any],
    fit_chars: int | None,
) -> str:
    """The chat rendered as text, bounded (``chat_jinja``): a plain chat there, any other one checked
    there under the same bounds first and then rendered by transformers. Every failure is one line."""
    tok = lm.tokenizer
    template = tok.chat_template
    bounds = _bounds(lm, messages, extra)
    if fit_chars is not None and fit_chars < bounds.max_chars:
        bounds = Bounds(max_chars=fit_chars)
    specials = dict(getattr(tok, "special_tokens_map", {}) or {})
    try:
        if chat_jinja.supported(template) and chat_jinja.plain(messages) and not extra:
            return chat_jinja.render(template, messages, add_generation_prompt, specials, bounds)
        chat_jinja.check(template, messages, add_generation_prompt, specials, extra.get("tools"), bounds)
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra)
    except RenderLimit as exc:
        if exc.output and fit_chars is not None and bounds.max_chars == fit_chars:
            raise ContextFullError(
                f"the chat renders to more than {fit_chars:,} characters of prompt, more than the context holds"
            ) from None
        raise ChatTemplateError(f"the chat template of {lm.name} stops: {exc}{_where(exc)}") from None
    except KvsnapError:
        raise
    except Exception as exc:  # a chat template is a program: it may fail in any way
        text = str(exc).strip().splitlines()
        first = text[0][:300] if text else type(exc).__name__
        raise ChatTemplateError(
            f"the chat template of {lm.name} cannot render this chat: {first} ({type(exc).__name__}{_where(exc, ', ')})"
        ) from None


def _where(exc: BaseException, sep: str = " (") -> str:
    line = template_line(exc)
    if line is None:
        return ""
    return f"{sep}template line {line}" + (")" if sep == " (" else "")


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
    lm: LoadedModel,
    messages: Sequence[dict[str, Any]],
    found: list[str],
    specials: set[str],
    add_generation_prompt: bool,
    extra: dict[str, Any],
    cut: str | None = None,
    fit_chars: int | None = None,
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
    tok = lm.tokenizer
    text = _after(_apply(lm, masked, add_generation_prompt, extra, fit_chars), cut)
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
