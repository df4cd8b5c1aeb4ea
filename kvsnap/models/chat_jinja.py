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
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

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
    template: str, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool, special_tokens: Mapping[str, str]
) -> str:
    """The text of ``messages`` in ``template``; raises jinja2's errors as transformers' rendering does
    (``raise_exception`` in a template: ``jinja2.exceptions.TemplateError``)."""
    if not supported(template) or not plain(list(messages)):
        raise ValueError("not a template and chat this module renders: use transformers' apply_chat_template")
    # kwargs overwrite the special tokens in transformers; here there are none to overwrite.
    return compiled(template).render(
        **dict(special_tokens),
        messages=[dict(m) for m in messages],
        tools=None,
        documents=None,
        add_generation_prompt=add_generation_prompt,
    )


@lru_cache(maxsize=16)
def compiled(template: str) -> Any:
    """The template compiled in transformers' sandbox (once per template text)."""
    import jinja2
    import jinja2.ext
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

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)
