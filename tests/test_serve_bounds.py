"""What a client sends cannot make ``kvsnap serve``'s library do unbounded work or fail with a 500:
huge prompts are refused by their length before any tokenizing, JSON structures are bounded, and
every number a request may carry ends in an answer or a 400. In-process, with the tiny model."""

from __future__ import annotations

import json
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsnap.config import SessionConfig
from kvsnap.models.plain_tokenizer import longest_token_bytes
from kvsnap.serve import CHAT, COMPLETION, ServeError, Service, parse_request
from kvsnap.serve.body import MAX_DEPTH, MAX_VALUES, parse_json


def _service(lm) -> Service:
    return Service(lm, SessionConfig(block_size=16, chunk_size=32), model_id="tiny")


def _chat(content: str, **fields) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}], **fields}).encode()


def test_a_prompt_too_long_to_fit_is_refused_before_any_tokenizing(llama, monkeypatch):
    service = _service(llama)
    assert service.text_limit == service.context * longest_token_bytes(llama.tokenizer)
    tok = type(llama.tokenizer)

    def never(*args, **kwargs):
        raise AssertionError("tokenized a prompt that cannot fit")

    for name in ("__call__", "encode", "apply_chat_template"):
        monkeypatch.setattr(tok, name, never, raising=False)
    over = "ab" * (service.text_limit // 2 + 1)
    for req in (parse_request(_chat(over), CHAT), parse_request(json.dumps({"prompt": over}).encode(), COMPLETION)):
        started = time.perf_counter()
        with pytest.raises(ServeError) as info:
            service.complete(req)
        assert info.value.status == 400 and info.value.code == "context_length_exceeded"
        assert "bytes of text" in info.value.message and time.perf_counter() - started < 1
    # Multi-byte text is measured in bytes: fewer characters than the limit, more bytes.
    wide = "\u00e9" * (service.text_limit // 2 + 1)
    with pytest.raises(ServeError):
        service.check_size(parse_request(_chat(wide), CHAT))
    service.check_size(parse_request(_chat("\u00e9" * (service.text_limit // 4)), CHAT))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(min_size=1, max_size=400))
def test_no_text_has_more_bytes_than_its_tokens_can_hold(llama, text):
    """The bound the early refusal rests on: n tokens never stand for more than n x the longest token."""
    tok = llama.tokenizer
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(text.encode("utf-8", "surrogatepass")) <= len(ids) * longest_token_bytes(tok)


def test_long_texts_tokenize_without_holding_the_gil(llama):
    tok = llama.tokenizer
    text = "The quick brown fox jumps over the lazy dog. " * 20_000
    gaps: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    started = time.perf_counter()
    try:
        ids = tok(text, add_special_tokens=False)["input_ids"]
    finally:
        took = time.perf_counter() - started
        stop.set()
        ticker.join()
    assert ids == tok.encode(text, add_special_tokens=False)
    # Another thread kept running while the tokenizer worked (it held the GIL for the whole text).
    assert max(gaps) < max(0.25, took / 3), (max(gaps), took)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"messages": [{"role": "user", "content": "hi"}], "metadata": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
        b'{"messages": [{"role": "user", "content": "hi"}], "metadata": ' + b'{"a":' * 10_000 + b"1" + b"}" * 10_001,
        b'{"messages": [{"role": "user", "content": "hi"}], "metadata": [' + b"0," * (MAX_VALUES + 5) + b"0]}",
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}',
        b"[" * 100_000,
    ],
)
def test_json_too_deep_too_big_or_not_strict_is_a_400(raw):
    started = time.perf_counter()
    with pytest.raises(ServeError) as info:
        parse_request(raw, CHAT)
    assert info.value.status == 400 and info.value.code == "invalid_json"
    assert time.perf_counter() - started < 5


def test_json_within_bounds_reads_as_json_loads_does():
    nested = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    for text in ('{"a": [1, 2.5, -3e2, true, false, null, "\\u00e9\\ud83d\\ude00", {}]}', nested, ' "x" '):
        assert parse_json(text.encode()) == json.loads(text)
    assert parse_json(json.dumps({"k": "v"}).encode("utf-16")) == {"k": "v"}


# -- every number a request may carry -------------------------------------------------------------

NUMBERS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(min_value=0, max_value=1e-30),
    st.sampled_from([0, 1, 1e-38, 1e-45, 5e-324, 1e-46, 2**63, 2**63 - 1, 2**64, -1, 0.5, 1.0000001, 1e308]),
    st.text(max_size=3),
)
FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "max_completion_tokens",
    "seed",
    "n",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "logprobs",
    "top_logprobs",
)


@pytest.fixture(scope="module")
def small_service(tiny_model_dir):
    """A service whose context is 48 tokens: however large max_tokens is, an answer stays short."""
    from kvsnap.models import load_model

    return _service(load_model(str(tiny_model_dir("llama")), device="cpu", ctx_size=48))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=st.dictionaries(st.sampled_from(FIELDS), NUMBERS, max_size=5), kind=st.sampled_from([CHAT, COMPLETION]))
def test_any_number_in_a_request_is_an_answer_or_a_400(small_service, fields, kind):
    raw = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "prompt": "Once", **fields}).encode()
    try:
        req = parse_request(raw, kind)
        done = small_service.complete(req)
    except ServeError as exc:
        assert exc.status == 400, exc.message
        assert exc.param in (*FIELDS, None), exc.param
        return
    assert done.finish_reason in ("stop", "length")
    assert done.completion_tokens <= small_service.context


@pytest.mark.parametrize(
    "fields", [{"temperature": 1e-38}, {"temperature": 5e-324}, {"top_p": 1e-46}, {"top_p": 5e-324, "temperature": 1}]
)
def test_vanishing_temperature_or_top_p_is_greedy(small_service, fields):
    req = parse_request(_chat("Once upon a time", max_tokens=6, seed=1, **fields), CHAT)
    greedy = parse_request(_chat("Once upon a time", max_tokens=6, temperature=0), CHAT)
    assert small_service.complete(req).text == small_service.complete(greedy).text


# -- who sees which figures -----------------------------------------------------------------------


def test_a_key_sees_its_own_figures_and_only_an_admin_the_whole_server(llama):
    from kvsnap.serve import ApiKeys

    keyed = ApiKeys(["alpha-key"], admin_keys=["admin-key"])
    assert keyed.is_admin("Bearer admin-key", "203.0.113.9")
    assert not keyed.is_admin("Bearer alpha-key", "127.0.0.1")  # with keys, this machine is no key
    assert not keyed.is_admin(None, "127.0.0.1")
    with pytest.raises(ServeError):
        keyed.namespace_for("Bearer admin-key")  # it opens the figures, it answers nothing
    open_server = ApiKeys()
    assert open_server.is_admin(None, "127.0.0.1") and open_server.is_admin(None, "::1")
    assert not open_server.is_admin(None, "192.0.2.7")
    with pytest.raises(Exception, match="differ"):
        ApiKeys(["same"], admin_keys=["same"])

    service = _service(llama)
    service.complete(parse_request(_chat("Hello", max_tokens=1, temperature=0), CHAT), "alice")
    own = service.stats("bob")
    assert own["ledger"]["requests"] == 0 and not {"hot_sessions", "store"} & set(own)
    everything = service.stats(None)
    assert everything["ledger"]["requests"] == 1 and everything["hot_sessions"] == 1
