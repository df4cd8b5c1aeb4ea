"""``kvsnap serve`` as clients see it: a real server in a subprocess, the official ``openai`` package.

The servers run a tiny model whose end-of-turn logit is pinned to zero, so its answers run to
``max_tokens``: lengths are known, and one request can be kept busy for as long as a test needs.
Greedy answers are compared with cold runs of the same model in this process. Every request goes
to 127.0.0.1; each server is killed at the end of its test or module.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
from typer.testing import CliRunner

from kvsnap.config import SamplingParams
from kvsnap.engine.session import Session
from kvsnap_cli.main import app

ROOT = Path(__file__).resolve().parents[1]
BS = 16
START_TIMEOUT_S = 120


class Server:
    """``kvsnap serve`` on a free port of 127.0.0.1 (``--port 0``; the port is read from its log)."""

    def __init__(self, log: Path, model: Path, store: Path, *args: str):
        self.log = log
        cmd = [
            sys.executable,
            "-m",
            "kvsnap_cli.main",
            "serve",
            "--model",
            str(model),
            "--device",
            "cpu",
            "--port",
            "0",
        ]
        cmd += ["--block-size", str(BS), "--chunk-size", "32", "--store", str(store), *args]
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, env=dict(os.environ))
        deadline = time.monotonic() + START_TIMEOUT_S
        while (found := re.search(r"http://127\.0\.0\.1:(\d+)/v1", log.read_text())) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"the server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        self.port = int(found.group(1))
        assert self.request("GET", "/health")[0] == 200

    def client(self, key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=key, max_retries=0, timeout=60)

    def request(self, method: str, path: str, body: bytes | dict | None = None, key: str | None = None):
        """(status, headers, parsed JSON body) of one plain HTTP request."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        conn.request(method, path, body=data, headers=headers)
        response = conn.getresponse()
        raw = response.read()
        conn.close()
        return response.status, dict(response.getheaders()), json.loads(raw) if raw else None

    def stats(self, key: str | None = None) -> dict:
        status, _, data = self.request("GET", "/v1/kvsnap/stats", key=key)
        assert status == 200, data
        return data

    def wait_for(self, what, timeout: float = 30.0) -> dict:
        """Poll the stats until ``what(stats)`` holds (bounded)."""
        deadline = time.monotonic() + timeout
        while not what(stats := self.stats()):
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
        return stats

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)


@pytest.fixture(scope="module")
def model(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny Llama with its end-of-turn token's output row zeroed: random logits elsewhere, so the
    greedy choice is (practically) never the end and every answer runs to max_tokens."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("serve-model") / "tiny-endless"
    shutil.copytree(tiny_model_dir("llama"), folder)
    weights = load_file(str(folder / "model.safetensors"))
    head = weights["lm_head.weight"].clone()
    head[2] = 0.0  # <|im_end|>, the tiny tokenizer's end of turn and end of text
    weights["lm_head.weight"] = head
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def lm(model, kvsnap_home):
    from kvsnap.models import load_model

    return load_model(str(model), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    running = Server(folder / "server.log", model, folder / "store", "--max-queue", "1")
    yield running
    running.kill()


def cold_chat(lm, messages: list[dict], max_tokens: int) -> str:
    session = Session(lm, block_size=BS, chunk_size=32)
    params = SamplingParams(max_new_tokens=max_tokens, temperature=0)
    return session.run(session.render_chat(messages), params).text


def cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def stream_chat(client, messages, max_tokens: int) -> tuple[str, object]:
    """Text and usage of a streamed answer."""
    pieces, usage = [], None
    stream = client.chat.completions.create(
        model="tiny-endless",
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    return "".join(pieces), usage


def test_models_and_health(server):
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["tiny-endless"]
    assert client.models.retrieve("tiny-endless").id == "tiny-endless"
    assert server.request("GET", "/health")[2] == {"status": "ok"}


def test_a_three_turn_chat_reuses_each_turn_and_answers_as_the_same_chat_in_process(server, lm):
    client = server.client()
    messages = [
        {"role": "system", "content": "You are the reference desk of a railway museum; answer briefly."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    # The server runs each turn on the ids the earlier ones ran, as a chat does: the same answers.
    reference = Session(lm, block_size=BS, chunk_size=32)
    previous_prompt = None
    for turn in range(3):
        expected = reference.chat(
            messages[-1]["content"], SamplingParams(max_new_tokens=8, temperature=0), system=messages[0]["content"]
        ).text
        if turn == 1:  # one turn streamed, the others not
            text, usage = stream_chat(client, messages, 8)
        else:
            answer = client.chat.completions.create(
                model="tiny-endless", messages=messages, max_tokens=8, temperature=0
            )
            text, usage = answer.choices[0].message.content, answer.usage
            assert answer.choices[0].finish_reason == "length" and answer.model == "tiny-endless"
        assert text == expected
        assert usage.completion_tokens == 8
        if previous_prompt is not None:
            assert cached(usage) == previous_prompt + 8 - 1  # all but the last answer token, which had no KV
        previous_prompt = usage.prompt_tokens
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": ["And of Italy?", "Who designed the viaduct?"][turn % 2]},
        ]
    ledger = server.stats()["ledger"]
    assert ledger["cached_tokens"] > 0 and ledger["prefill_tokens"] < ledger["prompt_tokens"]


def test_completions_stream_and_not_agree(server, lm):
    client = server.client()
    prompt = "Once upon a time there was a small cache that kept every key"
    whole = client.completions.create(model="tiny-endless", prompt=prompt, max_tokens=6, temperature=0)
    pieces = [
        c.choices[0].text
        for c in client.completions.create(
            model="tiny-endless", prompt=prompt, max_tokens=6, temperature=0, stream=True
        )
        if c.choices
    ]
    assert whole.choices[0].text == "".join(pieces)
    session = Session(lm, block_size=BS, chunk_size=32)
    ids = lm.tokenizer(prompt)["input_ids"]
    assert whole.choices[0].text == session.run(ids, SamplingParams(max_new_tokens=6, temperature=0)).text
    again = client.completions.create(model="default", prompt=prompt, max_tokens=1, temperature=0)
    assert cached(again.usage) > 0 and again.choices[0].finish_reason == "length"
    stop = whole.choices[0].text[2:4]
    stopped = client.completions.create(model="tiny-endless", prompt=prompt, max_tokens=6, temperature=0, stop=stop)
    assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].text


GOOD = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "param"),
    [
        ("POST", "/v1/chat/completions", b"{not json", 400, None),
        ("POST", "/v1/chat/completions", {"max_tokens": 2}, 400, "messages"),
        ("POST", "/v1/chat/completions", {**GOOD, "temperature": "warm"}, 400, "temperature"),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, 400, "messages[0].content"),
        ("POST", "/v1/chat/completions", {**GOOD, "stream": "yes"}, 400, "stream"),
        ("POST", "/v1/completions", {"prompt": 42}, 400, "prompt"),
        ("POST", "/v1/completions", {"prompt": "0123456789 " * 2000, "stream": True}, 400, "prompt"),
        ("POST", "/v1/chat/completions", {**GOOD, "model": "gpt-4o"}, 404, "model"),
        ("GET", "/v1/nowhere", None, 404, None),
        ("GET", "/v1/chat/completions", None, 405, None),
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_goes_on(server, method, path, body, status, param):
    got, _, data = server.request(method, path, body)
    assert got == status, data
    assert set(data["error"]) == {"message", "type", "param", "code"} and data["error"]["param"] == param
    assert "Traceback" not in json.dumps(data)
    assert server.request("POST", "/v1/chat/completions", GOOD)[0] == 200


def test_the_openai_client_sees_typed_errors(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=GOOD["messages"])
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny-endless", messages=[{"role": "user", "content": "x " * 5000}])
    assert info.value.code == "context_length_exceeded"


def test_a_full_line_is_a_503_and_a_client_that_leaves_frees_its_turn(server):
    client = server.client()
    before = server.stats()["ledger"]["cancelled"]
    busy = client.chat.completions.create(
        model="tiny-endless",
        messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=3000,
        temperature=0,
        stream=True,
    )
    next(c for c in busy if c.choices and c.choices[0].delta.content)  # it is running
    waiting: dict = {}
    thread = threading.Thread(target=lambda: waiting.update(r=server.request("POST", "/v1/chat/completions", GOOD)))
    thread.start()
    server.wait_for(lambda s: s["queue"]["waiting"] == 1)
    status, headers, data = server.request("POST", "/v1/chat/completions", GOOD)  # one runs, one waits: full
    assert status == 503 and int(headers["retry-after"]) >= 1 and data["error"]["code"] == "server_busy"
    busy.close()  # the client leaves mid-stream
    thread.join(60)
    assert waiting["r"][0] == 200 and waiting["r"][2]["usage"]["completion_tokens"] == 2
    stats = server.wait_for(lambda s: s["ledger"]["cancelled"] == before + 1 and not s["queue"]["running"])
    assert stats["queue"]["waiting"] == 0
    assert server.request("POST", "/v1/chat/completions", GOOD)[0] == 200


def test_a_restart_keeps_the_cache_and_each_key_its_own(model, lm, tmp_path):
    store, keys = tmp_path / "store", ["alpha-key", "beta-key"]
    args = ["--api-key", keys[0], "--api-key", keys[1]]
    messages = [
        {
            "role": "system",
            "content": "Blocks of tokens are hashed in a chain, so a prefix is found by its last block.",
        },
        {"role": "user", "content": "How is a prefix found?"},
    ]
    first = Server(tmp_path / "first.log", model, store, *args)
    try:
        with pytest.raises(openai.AuthenticationError):
            first.client("wrong-key").chat.completions.create(model="tiny-endless", messages=messages, max_tokens=2)
        assert first.request("POST", "/v1/chat/completions", GOOD)[0] == 401  # no key at all
        answer = first.client(keys[0]).chat.completions.create(
            model="tiny-endless", messages=messages, max_tokens=8, temperature=0
        )
    finally:
        first.kill()  # SIGKILL: nothing is flushed on the way out
    messages += [{"role": "assistant", "content": answer.choices[0].message.content}]
    messages += [{"role": "user", "content": "And where is the hash kept?"}]

    second = Server(tmp_path / "second.log", model, store, *args)
    try:
        text, usage = stream_chat(second.client(keys[0]), messages, 8)
        assert cached(usage) >= answer.usage.prompt_tokens // BS * BS > 0
        assert text == cold_chat(lm, messages, 8)
        other = second.client(keys[1]).chat.completions.create(
            model="tiny-endless", messages=messages, max_tokens=8, temperature=0
        )
        assert cached(other.usage) == 0  # the other key's namespace holds nothing of it
        assert other.choices[0].message.content == text
        assert second.stats(keys[1])["ledger"]["requests"] == 1  # each key sees its own totals
        assert second.request("GET", "/v1/models")[0] == 401
    finally:
        second.kill()


def test_a_host_other_machines_reach_needs_a_key():
    result = CliRunner().invoke(app, ["serve", "--host", "0.0.0.0", "--port", "0"])
    assert result.exit_code == 1
    assert "--api-key" in result.output and len(result.output.strip().splitlines()) == 1


def test_serve_has_help_and_refuses_conflicting_store_flags(tmp_path):
    help_text = CliRunner().invoke(app, ["serve", "--help"])
    assert help_text.exit_code == 0 and "--api-key" in help_text.output and "--max-queue" in help_text.output
    result = CliRunner().invoke(app, ["serve", "--no-store", "--store", str(tmp_path), "--port", "0"])
    assert result.exit_code == 1 and "--no-store" in result.output
