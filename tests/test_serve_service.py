"""``kvsnap serve``'s library without a socket: request checks, OpenAI shapes, keys, the line, the service."""

from __future__ import annotations

import asyncio
import json

import pytest
from openai.types import Completion as OpenAICompletion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from kvsnap.config import CHAT_SAMPLING, SamplingParams
from kvsnap.engine.session import Session
from kvsnap.prefix import common_prefix_len
from kvsnap.serve import (
    CHAT,
    COMPLETION,
    ApiKeys,
    Cancelled,
    ServeError,
    Service,
    Turns,
    is_loopback,
    parse_request,
    read_keys_file,
)
from kvsnap.serve import protocol as p
from kvsnap.store import BlockStore

BS = 16


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def chat_body(content: str = "hi", **fields) -> bytes:
    return body(messages=[{"role": "user", "content": content}], **fields)


# -- protocol -------------------------------------------------------------------------------------


def test_a_chat_request_is_read_into_its_fields():
    req = parse_request(
        body(
            model="m",
            messages=[
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None},
            ],
            max_tokens=5,
            max_completion_tokens=7,
            temperature=0,
            top_p=0.5,
            seed=3,
            stop="\n",
            stream=True,
            stream_options={"include_usage": True},
            user="someone",  # fields kvsnap does not use are accepted
            frequency_penalty=0,
        ),
        CHAT,
    )
    assert req.messages == (
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": ""},
    )
    assert (req.model, req.max_tokens, req.temperature, req.top_p, req.seed) == ("m", 7, 0.0, 0.5, 3)
    assert req.stop == ("\n",) and req.stream and req.include_usage
    # include_usage means nothing without a stream; a completion takes one prompt string.
    assert not parse_request(chat_body(stream_options={"include_usage": True}), CHAT).include_usage
    assert parse_request(body(prompt=["once"], max_tokens=2.0), COMPLETION).prompt == "once"


@pytest.mark.parametrize(
    ("raw", "kind", "param"),
    [
        (b"{not json", CHAT, None),
        (b"[1, 2]", CHAT, None),
        (b"\xff\xfe", CHAT, None),
        (body(model="m"), CHAT, "messages"),
        (body(messages=[]), CHAT, "messages"),
        (body(messages="hi"), CHAT, "messages"),
        (body(messages=[{"role": "wizard", "content": "x"}]), CHAT, "messages[0].role"),
        (body(messages=[{"role": "user", "content": 5}]), CHAT, "messages[0].content"),
        (body(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), CHAT, "messages[0].content"),
        (body(messages=[{"role": "user", "content": "\ud800"}]), CHAT, "messages[0].content"),
        (chat_body(temperature="hot"), CHAT, "temperature"),
        (chat_body(temperature=-1), CHAT, "temperature"),
        (chat_body(top_p=0), CHAT, "top_p"),
        (chat_body(max_tokens="10"), CHAT, "max_tokens"),
        (chat_body(max_tokens=2.5), CHAT, "max_tokens"),
        (chat_body(max_completion_tokens=-1), CHAT, "max_completion_tokens"),
        (chat_body(seed=True), CHAT, "seed"),
        (chat_body(seed=2**64), CHAT, "seed"),
        (chat_body(stop=[1]), CHAT, "stop"),
        (chat_body(stop=["x"] * 17), CHAT, "stop"),
        (chat_body(stream="yes"), CHAT, "stream"),
        (chat_body(stream=True, stream_options=[]), CHAT, "stream_options"),
        (chat_body(n=2), CHAT, "n"),
        (chat_body(logprobs=True), CHAT, "logprobs"),
        (chat_body(tools=[{"type": "function"}]), CHAT, "tools[0]"),
        (chat_body(model=5), CHAT, "model"),
        (body(), COMPLETION, "prompt"),
        (body(prompt=["a", "b"]), COMPLETION, "prompt"),
        (body(prompt=[1, 2, 3]), COMPLETION, "prompt"),
        (body(prompt="x", echo=True), COMPLETION, "echo"),
    ],
)
def test_a_bad_request_is_a_400_naming_its_field(raw, kind, param):
    with pytest.raises(ServeError) as info:
        parse_request(raw, kind)
    err = info.value
    assert err.status == 400 and err.param == param
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_answers_and_chunks_have_the_openai_shapes():
    use = p.usage(10, 3, 8)
    chat = ChatCompletion.model_validate(p.response(CHAT, "chatcmpl-1", 1, "m", "hello", "stop", use))
    assert chat.choices[0].message.content == "hello" and chat.usage.prompt_tokens_details.cached_tokens == 8
    assert chat.usage.total_tokens == 13
    text = OpenAICompletion.model_validate(p.response(COMPLETION, "cmpl-1", 1, "m", "hello", "length", use))
    assert text.choices[0].text == "hello" and text.choices[0].finish_reason == "length"
    first = ChatCompletionChunk.model_validate(p.chunk(CHAT, "c", 1, "m", "", first=True, with_usage=True))
    assert first.choices[0].delta.role == "assistant" and first.usage is None
    last = ChatCompletionChunk.model_validate(p.chunk(CHAT, "c", 1, "m", None, finish="length"))
    assert last.choices[0].finish_reason == "length" and last.choices[0].delta.content is None
    tail = ChatCompletionChunk.model_validate(p.usage_chunk(CHAT, "c", 1, "m", use))
    assert tail.choices == [] and tail.usage.completion_tokens == 3
    piece = p.chunk(COMPLETION, "c", 1, "m", "x")  # OpenAI streams these with finish_reason null, unvalidated
    assert piece["object"] == "text_completion" and piece["choices"][0]["text"] == "x"
    assert p.sse({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode() and p.DONE == b"data: [DONE]\n\n"


# -- keys -----------------------------------------------------------------------------------------


def test_each_key_has_its_own_namespace_and_others_get_401(tmp_path):
    assert ApiKeys([], "team").namespace_for(None) == "team"  # no keys: anyone, one namespace
    keys = ApiKeys(["alpha", "beta"], "team")
    a, b = keys.namespace_for("Bearer alpha"), keys.namespace_for("bearer  beta ")
    assert a != b and a.startswith("team#key-") and "alpha" not in a
    assert ApiKeys(["alpha"], "team").namespace_for("Bearer alpha") == a  # other keys do not move it
    for header in (None, "", "Bearer", "Bearer gamma", "Basic alpha", "alpha"):
        with pytest.raises(ServeError) as info:
            keys.namespace_for(header)
        assert info.value.status == 401 and info.value.code == "invalid_api_key"
    path = tmp_path / "keys"
    path.write_text("# team keys\nalpha\n\n  beta  \n")
    assert read_keys_file(path) == ["alpha", "beta"]
    path.write_text("# none\n")
    with pytest.raises(Exception, match="holds no key"):
        read_keys_file(path)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.9.9.9", True), ("::1", True), ("[::1]", True), ("localhost", True)]
    + [("0.0.0.0", False), ("::", False), ("192.168.1.5", False), ("example.org", False)],
)
def test_only_loopback_hosts_count_as_local(host, loopback):
    assert is_loopback(host) is loopback


# -- the line -------------------------------------------------------------------------------------


def test_requests_take_turns_in_arrival_order_and_a_full_line_is_a_503():
    async def scenario():
        turns = Turns(max_waiting=2)
        first, second, third = turns.reserve(), turns.reserve(), turns.reserve()
        with pytest.raises(ServeError) as info:
            turns.reserve()
        assert info.value.status == 503 and int(info.value.headers["Retry-After"]) >= 1
        order = []

        async def run(name, ticket):
            await ticket.wait()
            order.append(name)
            ticket.release()

        tasks = [asyncio.create_task(run(n, t)) for n, t in (("third", third), ("second", second))]
        await asyncio.sleep(0)
        assert order == [] and turns.snapshot() == {"running": True, "waiting": 2, "max_waiting": 2}
        first.release()
        await asyncio.gather(*tasks)
        assert order == ["second", "third"]  # arrival order, not the order of waiting
        # A request that leaves while it waits frees its place; the next one gets the turn.
        a, b, c = turns.reserve(), turns.reserve(), turns.reserve()
        b.release()
        assert turns.waiting == 1
        a.release()
        await asyncio.wait_for(c.wait(), 1)
        c.release()
        c.release()  # idempotent
        assert turns.snapshot() == {"running": False, "waiting": 0, "max_waiting": 2}
        # max_waiting 0: nobody waits, a second request while one runs is turned away.
        solo = Turns(max_waiting=0)
        held = solo.reserve()
        with pytest.raises(ServeError):
            solo.reserve()
        held.release()
        solo.reserve().release()

    asyncio.run(scenario())


# -- the service ----------------------------------------------------------------------------------


def chat(content: list[str] | str, answers: list[str] = (), **fields):
    """A chat request of user turns ``content`` with the given earlier answers between them."""
    turns = [content] if isinstance(content, str) else content
    messages = [{"role": "system", "content": "You keep every key and value."}]
    for i, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    fields.setdefault("temperature", 0)
    return parse_request(body(messages=messages, **fields), CHAT)


def cold(lm, req, prompt_ids: list[int] | None = None) -> str:
    """The greedy answer computed from nothing, to ``prompt_ids`` (default: ``req``'s messages rendered)."""
    session = Session(lm, block_size=BS, chunk_size=32)
    params = SamplingParams(max_new_tokens=req.max_tokens, temperature=0)
    return session.run(prompt_ids or session.render_chat(list(req.messages)), params).text


def test_a_conversation_reuses_each_turn_and_answers_as_a_cold_run(llama, tmp_path):
    service = Service(llama, _config(), BlockStore(tmp_path / "store"), model_id="tiny")
    questions = ["What is the capital of France?", "And of Italy?", "Tell me about the quick brown fox."]
    answers: list[str] = []
    previous = None
    prompts = []
    for i in range(3):
        req = chat(questions[: i + 1], answers, max_tokens=6)
        pieces: list[str] = []
        done = service.complete(req, on_text=pieces.append)
        # The prompt the model saw: the earlier turns as they ran, then the new message (serve.conversations).
        ran = service.session("").all_tokens[: done.prompt_tokens]
        assert done.text == "".join(pieces) == cold(llama, req, ran)
        if previous is not None:
            assert done.cached_tokens >= previous.prompt_tokens // BS * BS
            assert done.prefill_tokens == done.prompt_tokens - done.cached_tokens
        previous = done
        prompts.append(ran)
        answers.append(done.text)
    ledger = service.ledger()
    assert ledger["requests"] == 3 and ledger["cached_tokens"] > 0
    assert service.stats()["store"]["blocks"] > 0

    # A new service on the same store (a restarted server) finds the conversation there.
    again = Service(llama, _config(), BlockStore(tmp_path / "store"), model_id="tiny")
    req = chat(questions[:2], answers[:1], max_tokens=6)  # turn 2 once more
    done = again.complete(req)
    # It has no record of the conversation's ids: the messages are rendered, and the whole blocks they
    # share with what ran are reused.
    shared = common_prefix_len(again.prompt_ids(req), prompts[1])
    assert done.restored_from == "store" and done.cached_tokens == min(shared, len(prompts[1]) - 1) // BS * BS
    assert done.text == cold(llama, req)


def test_a_conversation_matched_by_its_messages_reuses_every_token_it_ran(llama, tmp_path):
    """Guards reuse lost at the first re-tokenized answer: sampled answers, sent back as text, render and
    tokenize otherwise; the request is matched to the conversation by its messages, and its ids are used."""
    service = Service(llama, _config(), None, model_id="tiny")
    questions = ["What is the capital of France?", "And of Italy?", "Tell me about the quick brown fox."]
    answers: list[str] = []
    differed = 0
    held = 0
    for i in range(3):
        req = chat(questions[: i + 1], answers, max_tokens=10, temperature=1.5, seed=7)
        rendered = service.prompt_ids(req)
        done = service.complete(req)
        if i:
            assert done.cached_tokens == held - 1  # all but the answer's last sampled token, which had no KV
            differed += service.session("").all_tokens[: done.prompt_tokens] != rendered
        held = done.prompt_tokens + done.completion_tokens
        answers.append(done.text)
    assert differed  # rendering the messages again would have given other ids here
    # A request that edits an earlier answer matches no conversation up to that answer: it is rendered whole,
    # and reuses the tokens before the answer.
    first_prompt = len(service.prompt_ids(chat(questions[:1], [], max_tokens=2)))
    edited = chat(questions[:3], [answers[0] + " (edited)", answers[1]], max_tokens=2)
    done = service.complete(edited)
    assert first_prompt <= done.cached_tokens < done.prompt_tokens and done.text == cold(llama, edited)


def test_namespaces_do_not_share_blocks(llama, tmp_path):
    service = Service(llama, _config(), BlockStore(tmp_path / "store"))
    req = chat("Blocks of tokens are hashed in a chain, so a prefix is found by its last block alone.", max_tokens=2)
    service.complete(req, "alice")
    assert service.complete(req, "alice").cached_tokens > 0
    bob = service.complete(req, "bob")
    assert bob.cached_tokens == 0 and bob.restored_from is None
    assert service.ledger("bob")["requests"] == 1 and service.ledger()["requests"] == 3


def test_a_cancelled_request_stops_and_the_session_stays_usable(llama):
    service = Service(llama, _config())
    req = chat("Once upon a time there was a small cache.", max_tokens=40)
    pieces: list[str] = []
    with pytest.raises(Cancelled):
        service.complete(req, on_text=pieces.append, cancelled=lambda: len(pieces) >= 2)
    assert len(pieces) == 2
    assert service.ledger()["cancelled"] == 1
    done = service.complete(req)
    assert done.cached_tokens > 0 and done.text == cold(llama, req)
    # Cancelled before any model work (the client left while it waited): nothing runs.
    with pytest.raises(Cancelled):
        service.complete(chat("A new question entirely."), cancelled=lambda: True)


def test_what_a_service_refuses(llama):
    service = Service(llama, _config(), model_id="tiny")
    with pytest.raises(ServeError) as info:
        service.complete(parse_request(chat_body(model="gpt-4"), CHAT))
    assert info.value.status == 404 and info.value.code == "model_not_found"
    service.check_model("tiny")
    service.check_model("default")
    with pytest.raises(ServeError) as info:
        service.complete(chat("0123456789 " * 2000))
    assert info.value.status == 400 and info.value.code == "context_length_exceeded"
    assert info.value.param == "messages"
    assert service.ledger()["failed"] == 1  # the 404 was refused before it counted as a request


def test_sampling_defaults_and_caps(llama):
    service = Service(llama, _config())
    completion = parse_request(body(prompt="The quick"), COMPLETION)
    assert service.sampling(completion, 10).max_new_tokens == 16  # OpenAI's default for completions
    params = service.sampling(chat("hi"), 10)
    assert params.max_new_tokens == CHAT_SAMPLING.max_new_tokens and params.temperature == 0
    assert service.sampling(chat("hi", temperature=None), 10).temperature == CHAT_SAMPLING.temperature
    huge = chat("hi", max_tokens=10**9)
    assert service.sampling(huge, 100).max_new_tokens == llama.max_positions - 100
    done = service.complete(parse_request(body(prompt="The quick", max_tokens=3, temperature=0), COMPLETION))
    assert done.completion_tokens <= 3 and done.finish_reason in ("length", "stop")


def _config():
    from kvsnap.config import SessionConfig

    return SessionConfig(block_size=BS, chunk_size=32)


def test_a_context_size_asked_for_bounds_what_a_service_takes(tiny_model_dir):
    from kvsnap.models import load_model

    lm = load_model(str(tiny_model_dir("llama")), device="cpu", ctx_size=64)
    service = Service(lm, _config())
    with pytest.raises(ServeError) as info:
        service.complete(chat("0123456789 " * 20))
    assert info.value.code == "context_length_exceeded" and "the context size asked for (64)" in info.value.message
    done = service.complete(chat("Hi", max_tokens=500, temperature=0))
    assert done.finish_reason == "length" and done.prompt_tokens + done.completion_tokens == 64
