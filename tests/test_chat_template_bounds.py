"""A model's chat template is its author's program, run on every chat: whatever it does, a
rendering stays within its bounds (size, steps, time) and every failure is one line.

Templates that allocate gigabytes or loop for minutes are stopped before they do (each test's
memory is traced); through the CLI each ends in one error line and exit 1, no traceback; in serve
a 400 with one line, and the next request is answered.
"""

from __future__ import annotations

import json
import tracemalloc

import pytest
from cli_helpers import kvsnap
from tiny_models import CHAT_TEMPLATE, with_chat_template

from kvsnap.config import SessionConfig
from kvsnap.models import chat_jinja
from kvsnap.models.template_bounds import Bounds, RenderLimit
from kvsnap.serve import CHAT, ServeError, Service, parse_request

HI = [{"role": "user", "content": "hi"}]
# Each would take gigabytes or minutes unbounded.
ATTACKS = {
    "repeat": "{{ 'x' * 300000000 }}",
    "strftime": "{{ strftime_now('%Y' * 50000000) }}",
    "nested-range": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "doubling-tilde": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "doubling-plus": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "captured-block": "{% set x %}{% for i in range(1000) %}{% for j in range(900) %}"
    + "y" * 10000
    + "{% endfor %}{% endfor %}{% endset %}{{ x | length }}",
    "center": "{{ 'x' | center(1000000000) }}",
    "percent-width": "{{ '%1000000000d' % 1 }}",
    "format-width": "{{ '{:>1000000000}'.format(1) }}",
    "replace": "{{ ('x' * 1000).replace('x', 'x' * 100000) }}",
    "join-filter": "{{ ([('x' * 1000000)] * 1000) | join }}",
    "join-method": "{{ ''.join([('x' * 1000000)] * 1000) }}",
    "lipsum": "{{ lipsum(n=1000000) }}",
    "power": "{{ 10 ** 100000000 }}",
    "macro-recursion": "{% macro f(n) %}{{ f(n) }}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "output": "{% for i in range(100000) %}{% for j in range(9) %}" + "z" * 1000 + "{% endfor %}{% endfor %}",
}


@pytest.mark.parametrize("template", ATTACKS.values(), ids=ATTACKS.keys())
def test_a_template_past_its_bounds_stops_before_it_allocates(template):
    tracemalloc.start()
    try:
        with pytest.raises(RenderLimit) as info:
            chat_jinja.render(template, HI, True, {})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "chat template" in str(info.value) and "\n" not in str(info.value)
    assert peak < 200 << 20, peak


def test_bounds_leave_a_normal_rendering_alone():
    big = [{"role": "user", "content": "word " * 200_000}]  # a long message: a long rendering, within bounds
    assert chat_jinja.render(CHAT_TEMPLATE, big, True, {}).count("word") == 200_000
    small = Bounds(max_chars=100)
    with pytest.raises(RenderLimit) as info:
        chat_jinja.render(CHAT_TEMPLATE, big, True, {}, small)
    assert info.value.output


# Sandbox escapes are refused by jinja2's sandbox; each refusal, and any other failure, is one line.
FAILURES = {
    "mro": "{{ ''.__class__.__mro__ }}",
    "cycler-globals": "{{ cycler.__init__.__globals__ }}",
    "lipsum-globals": "{{ lipsum.__globals__.os.popen('id').read() }}",
    "namespace-init": "{{ namespace.__init__.__globals__['sys'].modules }}",
    "no-tojson-global": "{{ tojson(messages) }}",
    "raise": "{{ raise_exception('roles must alternate') }}",
    "syntax": "{% for m in messages %}",
}


@pytest.fixture
def model_with(tiny_model_dir, tmp_path, kvsnap_home):
    def make(template: str):
        return with_chat_template(tiny_model_dir("llama"), tmp_path / "hostile", template)

    return make


@pytest.mark.parametrize(
    "template",
    [*FAILURES.values(), ATTACKS["repeat"], ATTACKS["strftime"], ATTACKS["nested-range"]],
    ids=[*FAILURES.keys(), "repeat", "strftime", "nested-range"],
)
def test_the_cli_reports_a_failing_template_in_one_line(model_with, template):
    folder = model_with(template)
    ran = kvsnap("run", "--model", folder, "--device", "cpu", "--chat", "--prompt", "hi", "--max-new-tokens", "1")
    assert ran.returncode == 1
    out = ran.stdout + ran.stderr
    assert "Traceback" not in out
    errors = [line for line in out.splitlines() if "chat template" in line]
    assert len(errors) == 1 and str(folder) in errors[0], out


def test_serve_answers_a_failing_template_with_a_400_and_goes_on(model_with):
    from kvsnap.models import load_model

    boom = "{% if messages[0].content == 'boom' %}{{ 'x' * 300000000 }}{% endif %}" + CHAT_TEMPLATE
    service = Service(load_model(str(model_with(boom)), device="cpu"), SessionConfig(block_size=16, chunk_size=32))

    def ask(content: str):
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
        return service.complete(parse_request(json.dumps(body).encode(), CHAT))

    with pytest.raises(ServeError) as info:
        ask("boom")
    assert info.value.status == 400 and "chat template" in info.value.message and "\n" not in info.value.message
    assert ask("hi").completion_tokens == 2


def test_a_chat_transformers_renders_is_bounded_first(tiny_model_dir, tmp_path, kvsnap_home):
    """A request with tools renders through transformers: the same bounds are checked before it does."""
    from tiny_models import TOOL_CHAT_TEMPLATE

    from kvsnap.models import load_model

    hostile = "{% if tools %}{{ 'x' * 300000000 }}{% endif %}" + TOOL_CHAT_TEMPLATE
    folder = with_chat_template(tiny_model_dir("qwen2"), tmp_path / "tools", hostile)
    service = Service(load_model(str(folder), device="cpu"), SessionConfig(block_size=16, chunk_size=32))
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    body = {"messages": HI, "max_tokens": 2, "tools": [tool]}
    tracemalloc.start()
    try:
        with pytest.raises(ServeError) as info:
            service.complete(parse_request(json.dumps(body).encode(), CHAT))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.value.status == 400 and "repetition" in info.value.message and "\n" not in info.value.message
    assert peak < 200 << 20, peak
    assert service.complete(parse_request(json.dumps({**body, "tools": None}).encode(), CHAT)).completion_tokens == 2
