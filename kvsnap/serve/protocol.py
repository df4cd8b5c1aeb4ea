"""The OpenAI wire shapes, without HTTP: requests checked into ``CompletionRequest``, answers and
stream chunks built as plain dicts, errors as ``ServeError``. No torch.

Checks are strict about types (a string where a number belongs is a 400 naming the field, not a
500 from deep inside sampling) and lenient about fields kvsnap does not use (``user``,
``metadata``, ``frequency_penalty``, ...): clients send those by default and expect no error.
What kvsnap cannot honour and a client would notice (``n`` > 1, ``logprobs``, image content) is
refused with a 400 rather than silently ignored. Tools, tool choices and tool messages are read by
``kvsnap.serve.tools``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from kvsnap.serve.body import TooLarge, parse_json
from kvsnap.serve.errors import ServeError, bad
from kvsnap.serve.tools import ToolCall, ToolChoice, parse_tools, tool_fields

__all__ = ["CHAT", "COMPLETION", "CompletionRequest", "ServeError", "bad", "parse_request"]

CHAT = "chat"
COMPLETION = "completion"

MAX_STOP = 16  # stop strings per request (OpenAI allows 4; a few more cost nothing)
MAX_SEED = 2**63
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}

# kvsnap's stop reasons as OpenAI finish reasons: every way an answer ends early on its own is
# "stop" (a repetition loop included); running out of tokens or context is "length".
FINISH_REASONS = {
    "eos": "stop",
    "stop": "stop",
    "repetition": "stop",
    "length": "length",
    "context": "length",
    "none": "length",  # max_tokens 0: nothing was generated
}


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """One checked request. ``None`` means "not given": the server's defaults apply."""

    kind: str  # CHAT or COMPLETION
    model: str | None
    messages: tuple[dict[str, Any], ...] | None  # chat: role and content, and tool fields where given
    prompt: str | None  # completion
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    tools: tuple[dict[str, Any], ...] = ()  # {"type": "function", "function": {...}} each
    tool_choice: ToolChoice | None = None  # None: no tools

    @property
    def param(self) -> str:
        """The field that holds the prompt, for errors about it."""
        return "messages" if self.kind == CHAT else "prompt"


def parse_body(body: bytes) -> dict[str, Any]:
    """The request's JSON object, or a 400 that says what is wrong with it."""
    try:
        data = parse_json(body)
    except TooLarge as exc:
        raise bad(str(exc), code="invalid_json") from None
    except (ValueError, RecursionError) as exc:
        raise bad(f"the request body is not valid JSON ({exc})", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad("the request body must be a JSON object", code="invalid_json")
    return data


def parse_request(body: bytes | dict[str, Any], kind: str) -> CompletionRequest:
    """Check a chat (``kind == CHAT``) or completion request; raises ``ServeError`` (400)."""
    data = parse_body(body) if isinstance(body, bytes) else body
    if kind == CHAT:
        messages, prompt = _messages(data.get("messages")), None
    else:
        messages, prompt = None, _prompt(data.get("prompt"))
    n = _integer(data, "n", 1)
    if n != 1:
        raise bad("only n=1 is supported (one answer per request)", "n")
    if data.get("logprobs") not in (None, False, 0) or data.get("top_logprobs") not in (None, 0):
        raise bad("logprobs are not supported", "logprobs")
    tools, tool_choice = (), None
    if kind == CHAT:
        tools, tool_choice = parse_tools(data)
    elif data.get("tools") is not None:
        raise bad("tools are for /v1/chat/completions", "tools")
    if kind == COMPLETION and data.get("echo"):
        raise bad("echo is not supported", "echo")
    limit_key = "max_completion_tokens" if data.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(data, limit_key, None)  # the newer name wins, as at OpenAI
    if max_tokens is not None and max_tokens < 0:
        raise bad(f"{limit_key} must be >= 0", limit_key)
    temperature = _number(data, "temperature")
    if temperature is not None and temperature < 0:
        raise bad("temperature must be >= 0", "temperature")
    top_p = _number(data, "top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise bad("top_p must be in (0, 1]", "top_p")
    top_k = _integer(data, "top_k", None)  # not OpenAI's, but llama.cpp and vLLM take it
    if top_k is not None and top_k < 0:
        raise bad("top_k must be >= 0", "top_k")
    seed = _integer(data, "seed", None)
    if seed is not None and not 0 <= seed < MAX_SEED:
        raise bad("seed must be in [0, 2**63)", "seed")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model must be a string", "model")
    stream = _boolean(data, "stream")
    options = data.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("stream_options must be an object", "stream_options")
    include_usage = _boolean(options or {}, "include_usage", "stream_options.include_usage")
    return CompletionRequest(
        kind=kind,
        model=model,
        messages=messages,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=_stop(data.get("stop")),
        stream=stream,
        include_usage=include_usage and stream,
        tools=tools,
        tool_choice=tool_choice,
    )


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise bad(f"{param} must be a string", param)
    try:
        value.encode("utf-8")  # JSON may carry a lone surrogate ("\ud800"), which no tokenizer takes
    except UnicodeEncodeError:
        raise bad(f"{param} is not valid Unicode text", param) from None
    return value


def _messages(value: Any) -> tuple[dict[str, Any], ...]:
    if value is None:
        raise bad("messages is required", "messages")
    if not isinstance(value, list) or not value:
        raise bad("messages must be a non-empty array of messages", "messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(f"{where} must be an object with role and content", where)
        role = message.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role must be one of {', '.join(ROLES)}", f"{where}.role")
        one: dict[str, Any] = {
            "role": ROLES[role],
            "content": _content(message.get("content"), role, f"{where}.content"),
        }
        if role in ("assistant", "tool"):
            one.update(tool_fields(message, role, where))
        out.append(one)
    return tuple(out)


def _content(value: Any, role: str, param: str) -> str:
    """A message's text: a string or an array of text parts (joined), as OpenAI allows."""
    if value is None and role == "assistant":
        return ""  # an assistant turn that only called tools
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad(f"{param}[{j}]: only text content parts are supported", param)
            parts.append(_text(part.get("text"), f"{param}[{j}].text"))
        return "".join(parts)
    return _text(value, param)


def _prompt(value: Any) -> str:
    if value is None:
        raise bad("prompt is required", "prompt")
    if isinstance(value, list):
        if len(value) != 1 or not isinstance(value[0], str):
            raise bad("prompt must be a string (or an array holding one string)", "prompt")
        value = value[0]
    return _text(value, "prompt")


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or len(items) > MAX_STOP:
        raise bad(f"stop must be a string or an array of at most {MAX_STOP} strings", "stop")
    return tuple(s for s in (_text(s, "stop") for s in items) if s)


def _integer(data: dict[str, Any], key: str, default: int | None) -> int | None:
    value = data.get(key)
    if value is None:
        return default
    # JSON has one number type: 3.0 is 3, 3.5 is an error; true is not 1.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad(f"{key} must be an integer", key)
    return value


def _number(data: dict[str, Any], key: str) -> float | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise bad(f"{key} must be a number", key)
    try:
        number = float(value)  # an integer of hundreds of digits is past any float
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise bad(f"{key} must be a finite number", key)
    return number


def _boolean(data: dict[str, Any], key: str, param: str | None = None) -> bool:
    value = data.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(f"{param or key} must be true or false", param or key)
    return value


# -- answers ---------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens`` is the prompt prefix that was not computed again."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def response(
    kind: str,
    rid: str,
    created: int,
    model: str,
    text: str,
    finish: str,
    use: dict[str, Any],
    tool_calls: tuple[ToolCall, ...] = (),
) -> dict:
    """A whole (non-streamed) answer; a chat answer's ``tool_calls`` in OpenAI's shape (its content
    null when it only called tools, as OpenAI's is)."""
    if kind == CHAT:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message["content"] = text or None
            message["tool_calls"] = [call.as_openai() for call in tool_calls]
        choice = {"index": 0, "message": message, "logprobs": None}
        obj = "chat.completion"
    else:
        choice, obj = {"index": 0, "text": text, "logprobs": None}, "text_completion"
    choice["finish_reason"] = finish
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice], "usage": use}


def chunk(
    kind: str,
    rid: str,
    created: int,
    model: str,
    text: str | None,
    *,
    finish: str | None = None,
    first: bool = False,
    with_usage: bool = False,
    tool_call: tuple[int, ToolCall] | None = None,
) -> dict[str, Any]:
    """One streamed piece: ``text`` (None: no text in it), ``finish`` on the last, or one whole
    ``tool_call`` (its index in the answer, the call) as ``delta.tool_calls``. With ``with_usage``
    (``stream_options.include_usage``) every chunk carries ``"usage": null``, as OpenAI's do."""
    if kind == CHAT:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        if tool_call is not None:
            delta["tool_calls"] = [tool_call[1].as_openai(tool_call[0])]
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
    if with_usage:
        out["usage"] = None
    return out


def usage_chunk(kind: str, rid: str, created: int, model: str, use: dict[str, Any]) -> dict[str, Any]:
    """The last chunk of a stream with ``include_usage``: no choices, the usage."""
    obj = "chat.completion.chunk" if kind == CHAT else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: {json}`` and a blank line (``data: [DONE]`` for the string)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


DONE = sse("[DONE]")


def model_card(model_id: str, created: int) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "kvsnap"}


def model_list(model_ids: list[str], created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(m, created) for m in model_ids]}
