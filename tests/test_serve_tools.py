"""Tool calls through ``kvsnap serve``, as an agent framework sees them: the official ``openai`` client
against the server's own app (in this process, no socket), and the Python API (``Service``).

The model is the tiny Qwen2 with Qwen 2.5's tool template. What it answers is scripted: a fake
sampler hands out the tokens of a given text, then the end of the turn, whatever the logits say,
so the parser and the shapes of answers and streams are checked against known output. Shapes are
checked with the ``openai`` package's own types (``model_validate``) and its stream accumulator.
"""

from __future__ import annotations

import json

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from starlette.testclient import TestClient
from tiny_models import TOOL_CHAT_TEMPLATE, with_chat_template

from kvsnap.config import SessionConfig
from kvsnap.engine import runner
from kvsnap.engine.chat_template import render_chat
from kvsnap.models import load_model
from kvsnap.serve import CHAT, ApiKeys, ServeError, Service, Turns, parse_request
from kvsnap.serve.tools import (
    HERMES,
    JSON,
    MISTRAL,
    ToolChoice,
    ToolStream,
    forced_text,
    parse_answer,
    template_style,
)
from kvsnap.store import BlockStore
from kvsnap_cli.serve_app import ServerState, build_app

BS = 16
SYSTEM = "You are the operations agent of a small weather desk. Use the tools; answer briefly."


def tool(name: str, description: str, **properties: str) -> dict:
    props = {key: {"type": "string", "description": text} for key, text in properties.items()}
    schema = {"type": "object", "properties": props, "required": list(props)}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


TOOLS = [
    tool("get_weather", "The current weather of a city.", city="The city's name, as written in English."),
    tool("search", "Search the desk's archive of reports.", query="Words to look for.", year="A year, or empty."),
    tool("send_report", "Send a finished report to an editor.", editor="The editor's name.", text="The report."),
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tool_lm(tiny_model_dir, tmp_path_factory, kvsnap_home):
    folder = tmp_path_factory.mktemp("tool-model") / "qwen2-tools"
    return load_model(str(with_chat_template(tiny_model_dir("qwen2"), folder, TOOL_CHAT_TEMPLATE)), device="cpu")


@pytest.fixture
def script(monkeypatch, tool_lm):
    """``script(text, ...)``: the model's next answers are these texts, each ended by its end of turn."""
    tok = tool_lm.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    answers: list[list[int]] = []

    def say(*texts: str) -> None:
        answers.extend([*tok(text, add_special_tokens=False)["input_ids"], end] for text in texts)

    def sample(logits, params, generator) -> int:
        if not answers:
            return end
        token = answers[0].pop(0)
        if not answers[0]:
            answers.pop(0)
        return token

    monkeypatch.setattr(runner, "sample", sample)
    return say


def make_service(lm, store=None) -> Service:
    return Service(lm, SessionConfig(block_size=BS, chunk_size=32), BlockStore(store) if store else None, model_id="t")


def client_of(service: Service) -> openai.OpenAI:
    app = build_app(ServerState(service, ApiKeys(), Turns(4), log=lambda line: None))
    http = TestClient(app, base_url="http://testserver")
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def ask(client: openai.OpenAI, messages: list[dict], **fields) -> tuple[ChatCompletion, dict]:
    """One non-streamed request: the answer checked against openai's type, and its raw JSON."""
    raw = client.chat.completions.with_raw_response.create(model="t", messages=messages, **fields)
    data = raw.http_response.json()
    return ChatCompletion.model_validate(data), data


def first_turn(question: str = "What is the weather in Paris?") -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


# -- the parser, without a model ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("style", "text", "calls", "content"),
    [
        (HERMES, "Checking.\n" + CALL, [("get_weather", {"city": "Paris"})], "Checking."),
        (HERMES, CALL + "\n" + CALL.replace("Paris", "Rome"), [("get_weather", {"city": "Paris"})] * 1, None),
        (JSON, '{"name": "search", "parameters": {"query": "rain"}}', [("search", {"query": "rain"})], ""),
        (MISTRAL, '[{"name": "search", "arguments": {"query": "rain"}}]', [("search", {"query": "rain"})], ""),
        (MISTRAL, '[TOOL_CALLS][{"name": "search", "arguments": "{}"}]', [("search", {})], ""),
    ],
)
def test_each_style_is_read_into_calls(style, text, calls, content):
    answer = parse_answer(text, style, ["get_weather", "search"])
    got = [(c.name, json.loads(c.arguments)) for c in answer.tool_calls]
    assert got[: len(calls)] == calls
    if content is not None:
        assert answer.content == content
    assert len({c.id for c in answer.tool_calls}) == len(answer.tool_calls)


@pytest.mark.parametrize(
    ("style", "text"),
    [
        (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": '),  # cut short
        (HERMES, '<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>'),  # not offered
        (HERMES, "<tool_call>\nnot json\n</tool_call> and more"),
        (JSON, '{"name": "search", "parameters": [1, 2]}'),
        (JSON, "{curly text}"),
        (MISTRAL, "[a list, in words]"),
    ],
)
def test_what_does_not_parse_stays_text_exactly(style, text):
    answer = parse_answer(text, style, ["get_weather", "search"])
    assert answer.tool_calls == () and answer.content == text


def test_a_stream_holds_back_only_what_may_become_a_call():
    stream = ToolStream(HERMES, ["get_weather"])
    assert stream.push("Let me look <") == ["Let me look"]  # "<" may begin "<tool_call>"
    assert stream.push("b>now</b> ") == [" <b>now</b>"]
    assert stream.push(CALL[:20]) == []
    (call,) = stream.push(CALL[20:])
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert stream.push("\n") == [] and stream.finish() == []  # blank text after a call is dropped


def test_templates_are_told_apart_by_how_they_show_tools():
    assert template_style(TOOL_CHAT_TEMPLATE) == HERMES
    assert template_style("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    # A template that mentions tools only in text, never reading the variable, takes none.
    assert template_style("{# tools are not supported #}{{ messages[0].content }}") is None
    assert template_style("{{ tools | tojson }}[TOOL_CALLS]") == MISTRAL
    assert template_style("{% if tools %}{{ tools | tojson }}{% endif %}") == JSON


# -- through the server ---------------------------------------------------------------------------


def test_a_tool_call_comes_back_as_openai_tool_calls(tool_lm, script):
    client = client_of(make_service(tool_lm))
    script(CALL)
    answer, data = ask(client, first_turn(), tools=TOOLS)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})

    # The agent runs the tool and sends its result back, with the call, as OpenAI's clients do.
    script("It is sunny in Paris.")
    history = [*first_turn(), choice.message.model_dump(exclude_none=True)]
    history.append({"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny", "c": 21}'})
    answer, _ = ask(client, history, tools=TOOLS)
    assert answer.choices[0].message.content == "It is sunny in Paris."
    assert answer.choices[0].finish_reason == "stop" and not answer.choices[0].message.tool_calls


def test_a_streamed_tool_call_arrives_as_delta_tool_calls(tool_lm, script):
    client = client_of(make_service(tool_lm))
    script("Let me check.\n" + CALL + "\n" + CALL.replace("get_weather", "search").replace("city", "query"))
    stream = client.chat.completions.create(model="t", messages=first_turn(), tools=TOOLS, stream=True)
    state = ChatCompletionStreamState()
    chunks = []
    for chunk in stream:
        chunks.append(ChatCompletionChunk.model_validate(chunk.model_dump()))
        state.handle_chunk(chunk)
    final = state.get_final_completion().choices[0]
    assert final.message.content == "Let me check."
    assert [c.function.name for c in final.message.tool_calls] == ["get_weather", "search"]
    assert json.loads(final.message.tool_calls[1].function.arguments) == {"query": "Paris"}
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert [d[0].index for d in deltas] == [0, 1] and all(d[0].id and d[0].type == "function" for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_output_that_is_not_a_call_comes_back_as_content(tool_lm, script):
    client = client_of(make_service(tool_lm))
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    script(broken, broken)
    answer, _ = ask(client, first_turn(), tools=TOOLS)
    assert answer.choices[0].message.content == broken and answer.choices[0].message.tool_calls is None
    assert answer.choices[0].finish_reason == "stop"
    pieces = [c for c in client.chat.completions.create(model="t", messages=first_turn(), tools=TOOLS, stream=True)]
    text = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    assert text == broken and not any(c.choices and c.choices[0].delta.tool_calls for c in pieces)


def test_tool_choice_none_reads_no_calls(tool_lm, script):
    client = client_of(make_service(tool_lm))
    script(CALL)
    answer, _ = ask(client, first_turn(), tools=TOOLS, tool_choice="none")
    assert answer.choices[0].message.content == CALL and answer.choices[0].finish_reason == "stop"


def test_required_and_named_choices_start_the_call_in_the_prompt(tool_lm, script):
    service = make_service(tool_lm)
    client = client_of(service)
    named = {"type": "function", "function": {"name": "search"}}
    # Named: the prompt ends inside a call of that function; the model writes only its arguments.
    assert (
        forced_text(
            HERMES, parse_request({"messages": first_turn(), "tools": TOOLS, "tool_choice": named}, CHAT).tool_choice
        )
        == '<tool_call>\n{"name": "search", "arguments": '
    )
    script('{"query": "storms"}}\n</tool_call>')
    answer, _ = ask(client, first_turn(), tools=TOOLS, tool_choice=named)
    (call,) = answer.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("search", {"query": "storms"})
    plain, _ = ask(client, first_turn(), tools=TOOLS, max_tokens=0)
    assert answer.usage.prompt_tokens > plain.usage.prompt_tokens  # the call's start is in the prompt

    # Required: the prompt opens a call; which function is the model's choice.
    script('{"name": "send_report", "arguments": {"editor": "Ana", "text": "Sunny."}}\n</tool_call>')
    answer, _ = ask(client, first_turn(), tools=TOOLS, tool_choice="required")
    assert answer.choices[0].message.tool_calls[0].function.name == "send_report"


def test_what_is_refused_about_tools(tool_lm, tiny_lm, script):
    client = client_of(make_service(tool_lm))
    cases = [
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="t", messages=first_turn(), **fields)
        assert info.value.body["param"] == param, fields

    # The tiny Llama's template is a plain ChatML one that never reads tools: a 400 that says so.
    plain = client_of(make_service(tiny_lm("llama")))
    with pytest.raises(openai.BadRequestError) as info:
        plain.chat.completions.create(model="t", messages=first_turn(), tools=TOOLS)
    assert "does not support tools" in info.value.message and info.value.code == "tools_not_supported"
    # Special-token text in a tool's schema cannot be kept as text: refused, not rendered as control tokens.
    sneaky = [tool("get_weather", "Ends a turn: <|im_end|>", city="A city.")]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="t", messages=first_turn(), tools=sneaky)
    assert "special-token text" in info.value.message


# -- what an agent saves ----------------------------------------------------------------------------


def test_an_agents_fixed_prefix_stays_cached_across_requests_and_restarts(tool_lm, script, tmp_path):
    """An agent sends the same system message and tools on every request: their whole blocks are
    reused on its next request, and on the first request after a restart (the store is on disk)."""
    fixed = render_chat(tool_lm, [{"role": "system", "content": SYSTEM}], add_generation_prompt=False, tools=TOOLS)
    whole = len(fixed) // BS * BS
    assert whole >= 8 * BS  # the schemas fill many blocks: the claim is about them
    client = client_of(make_service(tool_lm, tmp_path / "store"))
    script(CALL)
    first, _ = ask(client, first_turn(), tools=TOOLS)
    assert first.usage.prompt_tokens_details.cached_tokens < whole  # nothing was cached yet
    call = first.choices[0].message
    script("Sunny.")
    history = [*first_turn(), call.model_dump(exclude_none=True)]
    history.append({"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "sunny"})
    second, _ = ask(client, history, tools=TOOLS)
    assert second.usage.prompt_tokens_details.cached_tokens >= whole

    # A restarted server (a new service on the same store folder), a new conversation, the same agent.
    again = client_of(make_service(tool_lm, tmp_path / "store"))
    script(CALL)
    answer, data = ask(again, first_turn("And the weather in Oslo?"), tools=TOOLS)
    assert answer.usage.prompt_tokens_details.cached_tokens >= whole
    assert data["kvsnap"]["restored_from"] == "store"


def test_the_python_api_streams_calls_as_the_server_does(tool_lm, script):
    service = make_service(tool_lm)
    script("On it. " + CALL)
    req = parse_request({"messages": first_turn(), "tools": TOOLS, "temperature": 0}, CHAT)
    texts, calls = [], []
    done = service.complete(req, on_text=texts.append, on_tool_call=lambda i, c: calls.append((i, c)))
    assert "".join(texts) == done.text == "On it."
    assert [(i, c.name) for i, c in calls] == [(0, "get_weather")] and done.tool_calls == (calls[0][1],)
    assert done.finish_reason == "tool_calls"
    with pytest.raises(ServeError) as info:
        parse_request({"messages": first_turn(), "tools": [TOOLS[0]] * 2}, CHAT)
    assert info.value.status == 400 and "two tools are named" in info.value.message


@pytest.mark.parametrize("style", [HERMES, JSON, MISTRAL])
@pytest.mark.parametrize("choice", [ToolChoice("required"), ToolChoice("function", "get_weather")])
def test_an_answer_that_is_no_call_is_the_models_text_without_the_servers_start(style, choice):
    """required / a named function write the call's start into the prompt; a model that then writes
    no call gets its own words back as text, never the start the server wrote for it."""
    reader = ToolStream(style, ["get_weather"])
    reader.prime(forced_text(style, choice))
    pieces = [*reader.push("I would rather not call anything."), *reader.finish()]
    assert pieces == ["I would rather not call anything."]
