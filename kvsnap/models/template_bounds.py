"""Bounds on one chat template rendering (``kvsnap.models.chat_jinja`` runs templates under them):
the size of every value a template makes, captures and outputs, its loop steps and calls, its time.

What can make far more than it is given (repetition, concatenation, format widths, ``join``,
``replace``, padding) is measured before it runs, so a template past a bound stops before it
allocates; the rest is measured after. The rendering under way is a context variable: the
compiled template is shared, each rendering has its own budget.
"""

from __future__ import annotations

import contextvars
import functools
import re
import time
from dataclasses import dataclass
from typing import Any

from kvsnap.errors import ChatTemplateError

MAX_CHARS = 16 << 20  # any value and the whole rendering, where the caller gives no bound
MAX_STEPS = 1_000_000  # loop iterations and calls of one rendering
MAX_SECONDS = 5.0
_DIGITS = re.compile(r"\d+")


@dataclass(frozen=True, slots=True)
class Bounds:
    max_chars: int = MAX_CHARS
    steps: int = MAX_STEPS
    seconds: float = MAX_SECONDS


class RenderLimit(ChatTemplateError):
    """A rendering went past its bounds; ``output``: past ``max_chars`` of rendered text."""

    def __init__(self, message: str, output: bool = False):
        super().__init__(message)
        self.output = output


class Budget:
    __slots__ = ("max_chars", "steps", "deadline", "seconds")

    def __init__(self, bounds: Bounds):
        self.max_chars, self.steps, self.seconds = bounds.max_chars, bounds.steps, bounds.seconds
        self.deadline = time.monotonic() + bounds.seconds


# The rendering under way in this thread; none (compile-time constant folding): the default bounds.
current: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("kvsnap_template_budget", default=None)


def _limit() -> int:
    budget = current.get()
    return budget.max_chars if budget is not None else MAX_CHARS


def tick() -> None:
    budget = current.get()
    if budget is None:
        return
    budget.steps -= 1
    if budget.steps < 0:
        raise RenderLimit(f"the chat template took more than {MAX_STEPS:,} loop steps and calls")
    if time.monotonic() > budget.deadline:
        raise RenderLimit(f"the chat template ran for more than {budget.seconds:g} s")


def _refuse(size: int, what: str) -> None:
    if size > _limit():
        raise RenderLimit(f"the chat template makes {what} of {size:,} characters or items, more than {_limit():,}")


def sized(value: Any) -> Any:
    if isinstance(value, (str, list, tuple, dict, set)):
        _refuse(len(value), "a value")
    return value


def _text_size(items: Any) -> int:
    return sum(len(x) if isinstance(x, str) else 32 for x in items)


def _check_format(fmt: Any) -> None:
    """A width or precision in a format string allocates that many characters: none past the bound."""
    if isinstance(fmt, str):
        for digits in _DIGITS.findall(fmt):
            if len(digits) > 9 or int(digits) > _limit():
                raise RenderLimit(f"the chat template formats with a width of {digits[:12]}, more than {_limit():,}")


def _check_replace(s: Any, old: Any, new: Any, count: Any = -1) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        n = s.count(old) if old else len(s) + 1
        if isinstance(count, int) and count >= 0:
            n = min(n, count)
        _refuse(len(s) + n * (len(new) - len(old)), "a string")


def _check_width(s: Any, width: Any, lines: bool = False) -> None:
    if isinstance(width, int) and not isinstance(width, bool):
        per = (s.count("\n") + 1) if lines and isinstance(s, str) else 1
        _refuse((len(s) if isinstance(s, str) else 0) + width * per, "a string")


def check_binop(operator: str, left: Any, right: Any) -> None:
    sized = (str, list, tuple)
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, sized) and isinstance(n, int):
                _refuse(len(seq) * max(n, 0), "a repetition")
    elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
        _refuse(len(left) + len(right), "a concatenation")
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        if left.bit_length() * right > 8 * _limit():
            raise RenderLimit(f"the chat template raises {left.bit_length()}-bit number to the power {right:,}")
    elif operator == "%" and isinstance(left, str):
        _check_format(left)


def check_call(obj: Any, args: tuple, kwargs: dict) -> None:
    """Calls whose result can be far larger than their inputs, measured before they run."""
    name = getattr(obj, "__name__", "")
    target = getattr(getattr(obj, "__wrapped__", obj), "__self__", None)  # str.format: the sandbox's wrapper
    if not isinstance(target, str):
        return
    if name in ("format", "format_map"):
        _check_format(target)
    elif name == "replace" and len(args) >= 2:
        _check_replace(target, *args[:3])
    elif name in ("center", "ljust", "rjust", "zfill") and args:
        _check_width(target, args[0])
    elif name == "expandtabs":
        _check_width(target, (args[0] if args else kwargs.get("tabsize", 8)) * target.count("\t"))
    elif name == "join" and args:
        items = args[0]
        if isinstance(items, (list, tuple)):
            _refuse(_text_size(items) + len(target) * max(len(items) - 1, 0), "a string")


def _filter_check(name: str, args: tuple, kwargs: dict) -> None:
    """The built-in filters that can make far more than they are given, measured before they run
    (their arguments as jinja2 passes them: an eval context or environment first where they take one)."""
    if name == "join" and len(args) >= 2 and isinstance(args[1], (list, tuple)):
        sep = args[2] if len(args) > 2 else kwargs.get("d", "")
        _refuse(_text_size(args[1]) + len(str(sep)) * max(len(args[1]) - 1, 0), "a string")
    elif name == "replace" and len(args) >= 4:
        _check_replace(args[1], args[2], args[3], args[4] if len(args) > 4 else kwargs.get("count", -1))
    elif name == "center" and args:
        _check_width(args[0], args[1] if len(args) > 1 else kwargs.get("width", 80))
    elif name == "indent" and args:
        _check_width(args[0], args[1] if len(args) > 1 else kwargs.get("width", 4), lines=True)
    elif name in ("wordwrap", "truncate") and len(args) > 2:
        _check_width("", args[2])
    elif name == "format" and args:
        _check_format(args[0])
    elif name == "tojson":
        indent = kwargs.get("indent", args[2] if len(args) > 2 else None)
        if isinstance(indent, int) and indent > 64:
            raise RenderLimit(f"the chat template indents JSON by {indent:,}, more than 64")


def bounded_filter(name: str, fn: Any) -> Any:
    @functools.wraps(fn)  # keeps jinja2's pass_context / pass_environment mark
    def run(*args: Any, **kwargs: Any) -> Any:
        tick()
        _filter_check(name, args, kwargs)
        return sized(fn(*args, **kwargs))

    return run


def concat(parts: Any) -> str:
    """A block's captured output joined, measured first (jinja2's ``environment.concat``)."""
    parts = parts if isinstance(parts, list) else list(parts)
    size = sum(map(len, parts))
    if size > _limit():
        raise RenderLimit(f"the chat template captures {size:,} characters in a block, more than {_limit():,}")
    return "".join(parts)


def template_line(exc: BaseException) -> int | None:
    """The line of the template where ``exc`` was raised (jinja2 rewrites its traceback to them)."""
    line = getattr(exc, "lineno", None)
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line
