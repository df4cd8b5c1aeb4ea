"""kvsnap.models.chat_jinja: chat templates rendered without transformers, exactly as transformers renders them.

Every template and chat below renders (or fails, with the same error) as transformers'
``apply_chat_template(..., tokenize=False)`` does; what this module does not render as transformers
would is left to it; and a chat over the plain tokenizer never loads transformers' tokenizer.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_native import ROOT

from kvsnap.models import chat_jinja
from kvsnap.models.plain_tokenizer import PlainTokenizer, plain_tokenizer

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
# Whitespace control (trim_blocks, lstrip_blocks), loop controls, namespace, tojson, dict, the special tokens.
FEATURES = """{%- set ns = namespace(n=0) -%}
{% for m in messages %}
  {% if m.role == 'system' %}{% continue %}{% endif %}
  {% set ns.n = ns.n + 1 %}
  {{ ns.n }}: {{ m | tojson }} {{ dict(role=m.role) | tojson(indent=1) }}
  {% if ns.n > 2 %}{% break %}{% endif %}
{% endfor %}
{{ eos_token }}|{{ pad_token }}|{{ unk_token }}|{{ bos_token }}|{{ tools }}|{{ documents }}|{{ add_generation_prompt }}
"""
YEAR = "{{ strftime_now('%Y') | length }}:{{ messages | length }}"
SANDBOX = "{{ messages.__class__ }}{{ ''.__class__ }}{{ messages[0].items() | list | length }}"
NAMESPACE_ESCAPE = "{% set ns = namespace(_hidden=1) %}{{ ns }}"
UNDEFINED_CALL = "{{ nothing_here() }}"

CHATS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Hi <there> & 'you'  "}],
    [
        {"role": "user", "content": "é 中文 🎉\n\ttabs"},
        {"role": "assistant", "content": "typed <|im_end|> and </s>"},
        {"role": "user", "content": ""},
    ],
    [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}],
    [{"role": "tool", "content": '{"x": [1, 2]}', "name": "calc"}],
]


@pytest.fixture(scope="module")
def full(tiny_model_dir):
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    return TokenizersBackend.from_pretrained(str(tiny_model_dir("llama")))


def _outcome(fn, *args, **kwargs):
    try:
        return "ok", fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001  (the error, its type and message, is what is compared)
        return type(exc).__name__, str(exc)


TEMPLATES = [SMOLLM2, LLAMA3, MISTRAL, FEATURES, YEAR, SANDBOX, NAMESPACE_ESCAPE, UNDEFINED_CALL]


@pytest.mark.parametrize("template", TEMPLATES)
def test_templates_render_as_transformers_renders_them(template, full):
    assert chat_jinja.supported(template)
    seen = set()
    for chat in CHATS:
        assert chat_jinja.plain(chat)
        for gen in (True, False):
            ours = _outcome(chat_jinja.render, template, chat, gen, full.special_tokens_map)
            theirs = _outcome(
                full.apply_chat_template, chat, chat_template=template, tokenize=False, add_generation_prompt=gen
            )
            assert ours == theirs, (template, chat, gen)
            seen.add(ours[0])
    if template is MISTRAL:
        assert seen == {"ok", "TemplateError"}  # raise_exception raises what transformers raises
    if template is NAMESPACE_ESCAPE:
        assert seen == {"SecurityError"}


def test_what_is_not_rendered_here_is_left_to_transformers(tiny_model_dir):
    assert not chat_jinja.supported("{% generation %}{{ messages[0].content }}{% endgeneration %}")
    assert not chat_jinja.supported("{%+ generation +%}{{ messages[0].content }}{%- endgeneration -%}")
    assert chat_jinja.supported("{% set generations = 1 %}{{ generation_prompt }}")
    assert not chat_jinja.plain([])
    assert not chat_jinja.plain([{"role": "user", "content": None}])
    assert not chat_jinja.plain([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert not chat_jinja.plain([{"role": "assistant", "content": "x", "reasoning": "y"}])  # transformers renames it
    with pytest.raises(ValueError):
        chat_jinja.render(SMOLLM2, [{"role": "user", "content": None}], True, {})

    plain = plain_tokenizer(tiny_model_dir("llama"))
    blocks = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    text = plain.apply_chat_template(blocks, tokenize=False, add_generation_prompt=True)  # content blocks
    assert plain._full is not None  # transformers rendered it
    assert text == plain.full.apply_chat_template(blocks, tokenize=False, add_generation_prompt=True)
    chat = CHATS[0]  # positional arguments are transformers' (tools, ...): passed on as they are
    assert plain.apply_chat_template(chat, None, tokenize=False) == plain.full.apply_chat_template(
        chat, None, tokenize=False
    )


def test_a_chat_over_the_plain_tokenizer_never_loads_transformers_tokenizer(tiny_lm):
    from kvsnap.engine.chat_template import render_chat

    lm = tiny_lm("llama")
    tok = lm.tokenizer
    assert isinstance(tok, PlainTokenizer) and tok._full is None
    for chat in CHATS:
        ids = render_chat(lm, chat)
        assert tok._full is None
        # The same ids as the same chat rendered and tokenized through transformers' tokenizer.
        text = tok.full.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert tok.decode(ids) == text
        if "<|im_end|>" not in str(chat):
            assert ids == tok.full(text, add_special_tokens=False)["input_ids"]
        tok._full = None


def test_preload_compiles_the_template_and_leaves_transformers_alone(tiny_model_dir):
    import threading

    plain = plain_tokenizer(tiny_model_dir("llama"))
    chat_jinja.compiled.cache_clear()
    plain.preload()  # what `kvsnap chat` and `kvsnap serve` do once the model is loaded
    for thread in threading.enumerate():
        if thread.name == "kvsnap-tokenizer":
            thread.join(timeout=120)
    assert chat_jinja.compiled.cache_info().currsize == 1 and plain._full is None


@pytest.mark.parametrize("command", ["run", "chat"])
def test_a_chat_in_a_new_process_never_imports_transformers(command, tiny_model_dir):
    """`kvsnap run --chat` and `kvsnap chat` render their template with jinja2 only: no transformers import."""
    model = ["--model", str(tiny_model_dir("llama")), "--max-new-tokens", "2", "--temperature", "0"]
    args = ["run", *model, "--chat", "--prompt", "Hi", "--json"] if command == "run" else ["chat", *model]
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('transformers' in sys.modules, file=sys.stderr))\n"
        "from kvsnap_cli.main import main\n"
        f"sys.argv = ['kvsnap', *{args!r}]\n"
        "main()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, input="Hi\n", capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip().splitlines()[-1] == "False", out.stderr
    assert ('"new_tokens": 2' in out.stdout) if command == "run" else ("2 new" in out.stderr)


@pytest.mark.slow
def test_the_default_models_template_renders_as_transformers_renders_it(real_model_folder):
    from transformers import AutoTokenizer

    folder = real_model_folder
    plain, full = plain_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    assert isinstance(plain, PlainTokenizer) and chat_jinja.supported(plain.chat_template)
    for chat in CHATS:
        for gen in (True, False):
            ours = plain.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert ours == full.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
    assert plain._full is None
