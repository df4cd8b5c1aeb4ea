"""OpenAI tool calling in and out: ``tools``, ``tool_choice`` and tool messages checked, and the
model's answer parsed back into tool calls, whole or as it streams. No torch, no model.

Rendering goes through the model's own chat template (``kvsnap.serve.tool_prompt``); this module
knows the three shapes templates teach a model to call a tool in (``STYLES``):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, once per call (Hermes,
  Qwen 2.5/3, many fine-tunes);
- ``json``: the answer is a bare JSON object ``{"name": ..., "parameters": {...}}``, several joined
  by ``;`` (Llama 3.1/3.2: the template teaches it in words);
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` (the special token
  itself is dropped when the answer is decoded, so the array alone is read).

Anything that does not parse as a call of one of the offered tools stays the answer's text: a
model that half writes a call gives its text back, never an error.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from kvsnap.serve.errors import bad

HERMES, JSON, MISTRAL = "hermes", "json", "mistral"
STYLES = (HERMES, JSON, MISTRAL)
CHOICES = ("auto", "none", "required")
MAX_TOOLS = 128  # OpenAI's own limit
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_MISTRAL_TAG = "[TOOL_CALLS]"
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's rule for a function's name


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """``tool_choice``: ``auto``, ``none``, ``required``, or ``function`` with the function's ``name``."""

    mode: str
    name: str | None = None

    @property
    def parses(self) -> bool:
        """Whether the answer is read for tool calls (``none``: it is all text)."""
        return self.mode != "none"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model made: ``arguments`` is JSON text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        """The call in OpenAI's shape; with ``index``, as a stream's ``delta.tool_calls`` entry."""
        out: dict[str, Any] = {} if index is None else {"index": index}
        out.update({"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}})
        return out


@dataclass(frozen=True, slots=True)
class ToolAnswer:
    """An answer read for tool calls: the text outside them and the calls, in order."""

    content: str
    tool_calls: tuple[ToolCall, ...]


# -- the request ------------------------------------------------------------------------------------


def parse_tools(data: dict[str, Any]) -> tuple[tuple[dict[str, Any], ...], ToolChoice | None]:
    """The request's ``tools`` (each ``{"type": "function", "function": {...}}``) and ``tool_choice``;
    no tools: ``((), None)``. Raises ``ServeError`` (400) naming the field that is wrong."""
    if data.get("functions") is not None or data.get("function_call") is not None:
        raise bad("functions and function_call are OpenAI's retired fields: send tools and tool_choice", "functions")
    raw, choice = data.get("tools"), data.get("tool_choice")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise bad("tool_choice needs tools", "tool_choice")
        return (), None
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise bad(f"tools must be an array of at most {MAX_TOOLS} tools", "tools")
    tools, names = [], set()
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad(f'{where} must be {{"type": "function", "function": {{...}}}}', where)
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad(f"{where}.function.name must be 1-64 letters, digits, _, . or -", f"{where}.function.name")
        if name in names:
            raise bad(f"{where}: two tools are named {name!r}", f"{where}.function.name")
        names.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise bad(f"{where}.function.description must be a string", f"{where}.function.description")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad(f"{where}.function.parameters must be a JSON Schema object", f"{where}.function.parameters")
        tools.append({"type": "function", "function": fn})
    return tuple(tools), _choice(choice, names)


def _choice(value: Any, names: set[str]) -> ToolChoice:
    if value is None:
        return ToolChoice("auto")
    if isinstance(value, str):
        if value not in CHOICES:
            raise bad(f"tool_choice must be one of {', '.join(CHOICES)} or a named function", "tool_choice")
        return ToolChoice(value)
    fn = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad('a named tool_choice is {"type": "function", "function": {"name": NAME}}', "tool_choice")
    if name not in names:
        raise bad(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return ToolChoice("function", name)


def tool_fields(message: dict[str, Any], role: str, where: str) -> dict[str, Any]:
    """The tool fields of one message, as chat templates read them: an assistant's ``tool_calls``
    (``arguments`` as an object where it is JSON text of one, as transformers' templates expect)
    and a tool message's ``tool_call_id`` and ``name``."""
    out: dict[str, Any] = {}
    if role == "assistant" and message.get("tool_calls") is not None:
        calls = message["tool_calls"]
        if not isinstance(calls, list):
            raise bad(f"{where}.tool_calls must be an array", f"{where}.tool_calls")
        out["tool_calls"] = [_past_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(calls)]
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if message.get(key) is not None:
                if not isinstance(message[key], str):
                    raise bad(f"{where}.{key} must be a string", f"{where}.{key}")
                out[key] = message[key]
    return out


def _past_call(call: Any, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad(f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}", where)
    arguments = fn.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        # Text that is not a JSON object is handed to the template as the text it is.
        arguments = parsed if isinstance(parsed, dict) else arguments
    elif not isinstance(arguments, dict):
        raise bad(f"{where}.function.arguments must be JSON text", f"{where}.function.arguments")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


# -- the template -----------------------------------------------------------------------------------


def template_style(template: Any) -> str | None:
    """How ``template`` teaches a model to call tools, or None when it takes no ``tools`` at all.

    A template is a program: one that never reads the ``tools`` variable cannot show the model a
    tool, whatever it is given. The style is told by the markers the template writes."""
    if isinstance(template, dict):  # transformers' named templates: the tool one where there is one
        template = template.get("tool_use") or template.get("default")
    if not isinstance(template, str) or "tools" not in template:
        return None
    return _style(template)


@lru_cache(maxsize=16)
def _style(template: str) -> str | None:
    """``template_style`` of a template's text (asked at every request with tools: cached)."""
    try:
        import jinja2
    except ImportError:
        return None
    from kvsnap.models.chat_jinja import variables

    try:
        names = variables(template)
    except jinja2.TemplateSyntaxError:
        return None
    if "tools" not in names:
        return None
    if _OPEN in template:
        return HERMES
    if _MISTRAL_TAG in template:
        return MISTRAL
    return JSON


def forced_text(style: str, choice: ToolChoice) -> str:
    """The start of the answer written into the prompt for ``required`` and a named function: the
    model then continues a call it cannot decline (and, named, of that function only)."""
    if choice.mode not in ("required", "function"):
        return ""
    name = json.dumps(choice.name) if choice.name else None
    if style == HERMES:
        return f'{_OPEN}\n{{"name": {name}, "arguments": ' if name else f"{_OPEN}\n"
    if style == MISTRAL:
        return f'{_MISTRAL_TAG}[{{"name": {name}, "arguments": ' if name else f"{_MISTRAL_TAG}["
    return f'{{"name": {name}, "parameters": ' if name else '{"name": '


# -- the answer -------------------------------------------------------------------------------------


def parse_answer(text: str, style: str, names: Sequence[str]) -> ToolAnswer:
    """``text`` read for calls of the tools ``names`` in ``style``."""
    stream = ToolStream(style, names)
    pieces = [*stream.push(text), *stream.finish()]
    content = "".join(p for p in pieces if isinstance(p, str))
    return ToolAnswer(content, tuple(p for p in pieces if isinstance(p, ToolCall)))


class ToolStream:
    """Reads an answer for tool calls as its text arrives: ``push`` and ``finish`` return what is
    final, text (``str``) and calls (``ToolCall``) in order. Text that may still turn into a call is
    held back; a call is given whole once it is closed (``hermes``) or the answer ends."""

    def __init__(self, style: str, names: Sequence[str]):
        if style not in STYLES:
            raise ValueError(f"unknown tool call style {style!r}")
        self.style = style
        self.names = set(names)
        self.buffer = ""
        self.inside = False  # hermes: within <tool_call>...; json, mistral: the answer is a call
        self.decided = False  # json, mistral: whether the answer starts as a call is known
        self.calls = 0
        self.held = ""  # blank text outside calls, given only if no call comes
        self.injected = ""  # the answer's start the server wrote into the prompt, until it is read

    def prime(self, text: str) -> None:
        """Read ``text`` as the answer's start the server wrote into the prompt (``forced_text``):
        where the model's answer does not complete it into a call, its text is given without it."""
        self.injected = text
        self.push(text)

    def push(self, text: str) -> list[str | ToolCall]:
        self.buffer += text
        return self._own(self._hermes(final=False) if self.style == HERMES else self._whole(final=False))

    def finish(self) -> list[str | ToolCall]:
        """The rest, once the answer has ended (a call left open is read as it stands)."""
        out = self._own(self._hermes(final=True) if self.style == HERMES else self._whole(final=True))
        if self.held and not self.calls:
            out.append(self.held)
        self.buffer = self.held = ""
        return out

    def _own(self, pieces: list[str | ToolCall]) -> list[str | ToolCall]:
        """``pieces`` without the server's own start of the answer: only what the model wrote is text."""
        if not self.injected or not pieces:
            return pieces
        first, injected, self.injected = pieces[0], self.injected, ""
        if isinstance(first, str) and first.startswith(injected):
            rest = first[len(injected) :].lstrip()
            return [rest, *pieces[1:]] if rest else pieces[1:]
        return pieces

    def _hermes(self, final: bool) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        while True:
            if self.inside:
                end = self.buffer.find(_CLOSE)
                if end == -1 and not final:
                    return out
                body = self.buffer if end == -1 else self.buffer[:end]
                rest = "" if end == -1 else self.buffer[end + len(_CLOSE) :]
                calls = self._read(body)
                if calls is None:
                    out.extend(self._text(_OPEN + body + ("" if end == -1 else _CLOSE)))  # not a call: its text
                else:
                    out.extend(calls)
                self.buffer, self.inside = rest, False
                if end == -1:
                    return out
                continue
            start = self.buffer.find(_OPEN)
            if start != -1:
                out.extend(self._text(self.buffer[:start]))
                self.buffer, self.inside = self.buffer[start + len(_OPEN) :], True
                continue
            keep = 0 if final else _partial(self.buffer, _OPEN)
            out.extend(self._text(self.buffer[: len(self.buffer) - keep]))
            self.buffer = self.buffer[len(self.buffer) - keep :]
            return out

    def _text(self, text: str) -> list[str | ToolCall]:
        """Text outside calls. Blanks at its end are held until more text follows: blanks before a
        call, between calls or after the last are not the answer's content."""
        kept = text.rstrip()
        if not kept:
            self.held += text
            return []
        out, self.held = self.held + kept, text[len(kept) :]
        return [out]

    def _whole(self, final: bool) -> list[str | ToolCall]:
        if not self.decided:
            head = self.buffer.lstrip()
            if not head and not final:
                return []
            self.decided = True
            opener = "{" if self.style == JSON else "["
            self.inside = head.startswith(opener) or (self.style == MISTRAL and head.startswith(_MISTRAL_TAG))
        if not self.inside:
            text, self.buffer = self.buffer, ""
            return [text] if text else []
        if not final:
            return []
        body = self.buffer.strip()
        if self.style == MISTRAL and body.startswith(_MISTRAL_TAG):
            body = body[len(_MISTRAL_TAG) :]
        calls = self._read(body)
        return list(calls) if calls is not None else ([self.buffer] if self.buffer else [])

    def _read(self, body: str) -> list[ToolCall] | None:
        """The calls ``body`` holds, or None when any part of it is not a call of an offered tool."""
        try:
            values = _json_values(body)
        except ValueError:
            return None
        if self.style == MISTRAL and len(values) == 1 and isinstance(values[0], list):
            values = values[0]
        calls = []
        for value in values:
            call = _call(value, self.names)
            if call is None:
                return None
            calls.append(call)
        if not calls:
            return None
        self.calls += len(calls)
        self.held = ""
        return calls


def _json_values(text: str) -> list[Any]:
    """The JSON values in ``text``, one after another, separated by blanks or ``;``."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            return values
        value, at = decoder.raw_decode(text, at)
        values.append(value)


def _call(value: Any, names: set[str]) -> ToolCall | None:
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", value["name"], json.dumps(arguments, ensure_ascii=False))


def _partial(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (held back: it may become one)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
