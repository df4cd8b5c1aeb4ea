"""A chat template rendered as transformers' ``apply_chat_template(messages, tokenize=False)`` renders
it, with jinja2 alone, for plain chats.

Why: rendering through transformers' tokenizer costs a process that has not imported transformers
the import of its tokenizer stack and the load of the tokenizer, on the path of a first chat answer
or a ``kvsnap run --chat`` (docs/benchmarks.md). The template only needs jinja2.

"The same rendering" means transformers' sandbox and variables, copied from
``transformers.utils.chat_template_utils`` (5.17-5.24): an ``ImmutableSandboxedEnvironment`` with
``trim_blocks``, ``lstrip_blocks`` and the loop controls, its ``tojson`` filter (no HTML
escaping), ``raise_exception``, ``strftime_now``, a ``dict`` and a ``namespace`` that refuse
underscore names; the variables are the tokenizer's special-token map, ``messages``,
``tools=None``, ``documents=None`` and ``add_generation_prompt``. Only a plain chat takes this path
(``plain``): messages whose keys and values are all ``str``, none of them a reasoning field (which
transformers renames); templates using transformers' ``{% generation %}`` tag, or a jinja2 older
than 3.1.6 (transformers refuses those: known sandbox escapes), are left to transformers
(``supported``). ``tests/test_chat_jinja.py`` compares both renderings.

A template is third-party code run on every chat, so a rendering here is bounded (``Bounds``):
every value it makes (a string, a list), what it captures in a block and what it outputs stay
within ``max_chars`` characters, its loop iterations and calls within ``steps``, its time within
``seconds``. Repetition (``'x' * n``), concatenation, ``%`` and ``format`` widths, ``join``,
``replace``, padding and ``lipsum`` are measured before they run, so a template past a bound
stops with ``RenderLimit`` before it allocates the result. ``check`` runs a template over any
JSON-like chat under these bounds, for renderings that transformers then does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from kvsnap.models.template_bounds import (
    Bounds,
    Budget,
    RenderLimit,
    bounded_filter,
    check_binop,
    check_call,
    concat,
    current,
    sized,
    tick,
)

# transformers' names for a message's reasoning: it copies one to the others before rendering.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_GENERATION_TAG = re.compile(r"\{%[-+]?\s*(end)?generation\b")  # any whitespace control
_MIN_JINJA = (3, 1, 6)


def plain(messages: Any) -> bool:
    """Whether ``messages`` is a non-empty list of plain messages this module renders as transformers does."""
    if not isinstance(messages, list) or not messages:
        return False
    for m in messages:
        if type(m) is not dict or not all(type(k) is str and type(v) is str for k, v in m.items()):
            return False
        if any(field in m for field in _REASONING_FIELDS):
            return False
    return True


def supported(template: str) -> bool:
    """Whether ``template`` renders here (else: through transformers). Asked at every render: cached."""
    return isinstance(template, str) and _supported(template)


@lru_cache(maxsize=16)
def _supported(template: str) -> bool:
    if _GENERATION_TAG.search(template):
        return False
    try:
        import jinja2
    except ImportError:
        return False
    version = tuple(int(p) for p in re.findall(r"\d+", jinja2.__version__)[:3])
    return version >= _MIN_JINJA


def render(
    template: str,
    messages: Sequence[Mapping[str, str]],
    add_generation_prompt: bool,
    special_tokens: Mapping[str, str],
    bounds: Bounds = Bounds(),
) -> str:
    """The text of ``messages`` in ``template``; raises jinja2's errors as transformers' rendering does
    (``raise_exception`` in a template: ``jinja2.exceptions.TemplateError``), and ``RenderLimit``
    past ``bounds``."""
    if not supported(template) or not plain(list(messages)):
        raise ValueError("not a template and chat this module renders: use transformers' apply_chat_template")
    # kwargs overwrite the special tokens in transformers; here there are none to overwrite.
    variables = {
        **dict(special_tokens),
        "messages": [dict(m) for m in messages],
        "tools": None,
        "documents": None,
        "add_generation_prompt": add_generation_prompt,
    }
    return _bounded_render(compiled(template), variables, bounds)


def check(
    template: str,
    messages: Any,
    add_generation_prompt: bool,
    special_tokens: Mapping[str, str],
    tools: Any = None,
    bounds: Bounds = Bounds(),
) -> None:
    """Render ``template`` over a JSON-like chat (tools, tool calls) under ``bounds`` and drop the text:
    ``RenderLimit`` where it goes past them. The messages' reasoning fields are copied to each other
    name as transformers does, so the template takes the branches it takes there. jinja2's errors pass
    (transformers' own rendering reports them)."""
    if not supported(template):
        return
    chat = json.loads(json.dumps(list(messages)))
    for i, m in enumerate(chat):
        if isinstance(m, dict) and (r := next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)):
            chat[i] = {"thinking": r, **m, "reasoning_content": r}
    variables = {
        **dict(special_tokens),
        "messages": chat,
        "tools": json.loads(json.dumps(list(tools))) if tools else None,
        "documents": None,
        "add_generation_prompt": add_generation_prompt,
    }
    try:
        _bounded_render(compiled(template), variables, bounds)
    except RenderLimit:
        raise
    except Exception:  # noqa: BLE001  (the real rendering reports it)
        pass


def _bounded_render(tmpl: Any, variables: dict[str, Any], bounds: Bounds) -> str:
    token = current.set(Budget(bounds))
    try:
        out, size = [], 0
        for piece in tmpl.generate(**variables):
            size += len(piece)
            if size > bounds.max_chars:
                raise RenderLimit(f"the chat template renders more than {bounds.max_chars:,} characters", output=True)
            out.append(piece)
        return "".join(out)
    except RecursionError:
        raise RenderLimit("the chat template recurses too deep") from None
    except MemoryError:
        raise RenderLimit("the chat template ran out of memory") from None
    finally:
        current.reset(token)


@lru_cache(maxsize=16)
def compiled(template: str) -> Any:
    """The template compiled in transformers' sandbox (once per template text)."""
    return _environment().from_string(template)


def variables(template: str) -> set[str]:
    """The variables ``template`` reads from its caller; jinja2's ``TemplateSyntaxError`` if it does
    not parse. Parsed in the bounded sandbox: another environment would fold constant expressions
    (``'x' * 300000000``) while it reads them."""
    import jinja2.meta

    return set(jinja2.meta.find_undeclared_variables(_environment().parse(template)))


@lru_cache(maxsize=1)
def _environment() -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        # No attribute of a real dict class for a template to reach through.
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # A namespace that refuses dunder (any underscore) names: no way into CPython internals.
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                    "Please rename the attribute."
                )

    class BoundedCode(CodeGenerator):
        def writeline(self, x: str, node: Any = None, extra: int = 0) -> None:
            super().writeline(x, node, extra)
            if x == "_loop_vars = {}":  # the first line of every for loop's body: each iteration is a step
                super().writeline("environment.kvsnap_tick()")

        def visit_Concat(self, node: Any, frame: Any) -> None:  # ``a ~ b``
            self.write("environment.kvsnap_sized(")
            super().visit_Concat(node, frame)
            self.write(")")

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        # Intercepted operators are also never folded at compile time, so no constant is built there.
        intercepted_binops = frozenset({"*", "+", "**", "%"})
        code_generator_class = BoundedCode
        concat = staticmethod(concat)
        kvsnap_tick = staticmethod(tick)
        kvsnap_sized = staticmethod(sized)

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            check_binop(operator, left, right)
            return sized(super().call_binop(context, operator, left, right))

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            tick()
            check_call(__obj, args, kwargs)
            return sized(super().call(__context, __obj, *args, **kwargs))

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.filters = {name: bounded_filter(name, fn) for name, fn in env.filters.items()}
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    lipsum = env.globals["lipsum"]

    def bounded_lipsum(n=5, html=True, min=20, max=100):  # noqa: A002  (jinja2's argument names)
        if n * max > 100_000:
            raise RenderLimit(f"the chat template asks lipsum for {n:,} paragraphs of up to {max:,} words")
        return lipsum(n, html, min, max)

    env.globals["lipsum"] = bounded_lipsum
    return env
