"""A chat that outgrows its context stays open: the oldest turns leave the model's view, the conversation
(and its file) keeps them, and a resumed chat shows the model the same turns.

Tiny random-weight model, greedy, a small --ctx-size; chats run as subprocesses with stdin piped.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from core_helpers import rewrite_meta, write_test_snapshot
from typer.testing import CliRunner

from kvsnap.config import SamplingParams
from kvsnap.errors import ContextFullError, SaveError, SnapshotError
from kvsnap.format import Snapshot
from kvsnap_cli.main import app

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
CTX = 256
PARAMS = SamplingParams(max_new_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def small(model):
    """The tiny model with a context of ``CTX`` tokens."""
    from kvsnap.models import load_model

    return load_model(model, device="cpu", ctx_size=CTX)


def chat(model: str, lines: list[str], home: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvsnap_cli.main", "chat", "--model", model, "--device", "cpu"]
    cmd += ["--block-size", "16", "--temperature", "0", "--max-new-tokens", "6", *args]
    env = {**os.environ, "KVSNAP_HOME": str(home)}
    text = "".join(f"{line}\n" for line in lines)
    proc = subprocess.run(cmd, input=text, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def info(path: Path) -> dict:
    result = runner.invoke(app, ["inspect", str(path), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def turns(n: int, start: int = 0) -> list[str]:
    return [f"message {i}: tell me about the quick brown fox and the capital of France" for i in range(start, n)]


def session(lm, **settings):
    from kvsnap.engine.session import Session

    return Session(lm, block_size=16, **settings)


def test_a_chat_longer_than_its_context_answers_every_turn_and_keeps_them_all(model, tmp_path, kvsnap_home):
    path = tmp_path / "chat.kv"
    lines = turns(32)
    proc = chat(model, lines, kvsnap_home, "--ctx-size", str(CTX), "--system", "be brief", "--resume", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "the context is full:" in proc.stderr and "oldest turns left the model's view" in proc.stderr
    assert "more than the context" not in proc.stderr
    # Every turn was answered (one stats line each) and the file keeps all of them.
    assert proc.stderr.count(" prompt tokens: ") == 32
    held = info(path)
    messages = held["messages"]
    assert messages[0] == {"role": "system", "content": "be brief"}
    assert [m["content"] for m in messages if m["role"] == "user"] == lines
    assert sum(1 for m in messages if m["role"] == "assistant") == 32
    assert 0 < held["dropped_messages"] < len(messages) - 2 and held["dropped_messages"] % 2 == 0
    assert held["tokens"] <= CTX

    # Resumed with the same context: the same view, its KV reused whole; the chat goes on.
    again = chat(model, ["one more"], kvsnap_home, "--ctx-size", str(CTX), "--resume", str(path))
    assert again.returncode == 0, again.stderr
    out = held["dropped_messages"] // 2
    assert f"32 earlier turns ({out} of them out of the model's view" in again.stderr
    # Only the last answer may re-tokenize differently when the template renders it again.
    reused = int(re.search(r"prompt tokens: ([\d,]+) reused", again.stderr).group(1).replace(",", ""))
    assert held["tokens"] - 8 <= reused <= held["tokens"] and "the context is full" not in again.stderr
    after = info(path)
    assert [m["content"] for m in after["messages"] if m["role"] == "user"] == [*lines, "one more"]
    assert after["dropped_messages"] >= held["dropped_messages"]


def test_a_snapshot_larger_than_the_context_is_resumed_with_its_oldest_turns_out_of_view(model, tmp_path, kvsnap_home):
    path = tmp_path / "chat.kv"
    lines = turns(8)
    assert chat(model, lines, kvsnap_home, "--resume", str(path)).returncode == 0
    held = info(path)
    assert held["tokens"] > 128 and held["dropped_messages"] == 0
    proc = chat(model, ["and now?"], kvsnap_home, "--ctx-size", "128", "--resume", str(path))
    assert proc.returncode == 0, proc.stderr
    assert f"{path} does not fit the context size asked for (128 tokens): the " in proc.stderr
    assert "oldest turns left the model's view" in proc.stderr
    after = info(path)
    assert [m["content"] for m in after["messages"] if m["role"] == "user"] == [*lines, "and now?"]
    assert after["dropped_messages"] > 0 and after["tokens"] <= 128


def test_the_answer_after_a_drop_is_a_cold_run_over_the_kept_messages(small):
    s = session(small)
    dropped = None
    for text in turns(40):
        result = s.chat(text, PARAMS, system="be brief")
        assert len(s.all_tokens) <= CTX
        if result.dropped_turns and dropped is None:
            dropped = result
            shown = s.view_messages[:-1]  # what the model saw for this answer
    assert dropped is not None and s.dropped_messages > 0
    assert len(s.messages) == 81 and s.messages[0]["role"] == "system"
    assert [m["content"] for m in s.messages if m["role"] == "user"] == turns(40)
    assert shown[0] == s.messages[0] and len(shown) < 2 * 40
    # The kept turns are computed again (the system prompt's KV reused), and answer as a cold run would.
    assert 0 < dropped.hit_tokens < dropped.prompt_tokens
    cold = session(small)
    assert cold.run(cold.render_chat(shown), PARAMS).text == dropped.text


def test_a_resumed_session_continues_with_the_same_view(small, tmp_path):
    s = session(small)
    for text in turns(20):
        s.chat(text, PARAMS, system="be brief")
    assert s.dropped_messages > 0
    path = tmp_path / "c.kv"
    s.save(path)
    with Snapshot(path) as snap:
        assert snap.meta.dropped_messages == s.dropped_messages
    resumed = session(small)
    resumed.restore(path)
    assert resumed.messages == s.messages and resumed.view_messages == s.view_messages
    a, b = s.chat("next", PARAMS), resumed.chat("next", PARAMS)
    assert (a.text, a.dropped_turns, a.hit_tokens) == (b.text, b.dropped_turns, b.hit_tokens)
    assert b.prefill_tokens < b.prompt_tokens // 2 and resumed.view_messages == s.view_messages


def test_a_store_session_and_its_export_keep_the_view(small, tmp_path):
    from kvsnap.store import BlockStore
    from kvsnap.store.interchange import export_session

    store = BlockStore(tmp_path / "store")
    s = session(small, store=store)
    for text in turns(12):
        s.chat(text, PARAMS, system="be brief", store_session="talk")
    assert s.dropped_messages > 0
    resumed = session(small, store=store)
    resumed.restore_store_session("talk")
    assert resumed.messages == s.messages and resumed.view_messages == s.view_messages
    export_session(store, "talk", tmp_path / "talk.kv")
    with Snapshot(tmp_path / "talk.kv") as snap:
        assert snap.meta.dropped_messages == s.dropped_messages


def test_on_context_full_error_refuses_the_turn_and_changes_nothing(small):
    s = session(small, on_context_full="error")
    with pytest.raises(ContextFullError) as caught:
        for text in turns(40):
            s.chat(text, PARAMS)
    assert "\n" not in str(caught.value) and "on_context_full='drop_oldest'" in str(caught.value)
    messages, tokens = list(s.messages), list(s.tokens)
    with pytest.raises(ContextFullError):
        s.chat("again", PARAMS)
    assert s.messages == messages and s.tokens == tokens and s.dropped_messages == 0


def test_a_message_longer_than_the_context_is_refused_and_the_chat_goes_on(model, tmp_path, kvsnap_home):
    path = tmp_path / "chat.kv"
    proc = chat(model, ["hello", "word " * 400, "bye"], kvsnap_home, "--ctx-size", "128", "--resume", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "with only this message in view, more than the context size asked for (128)" in proc.stderr
    assert "the message was not sent" in proc.stderr
    assert [m["content"] for m in info(path)["messages"] if m["role"] == "user"] == ["hello", "bye"]


def test_the_stats_line_says_an_answer_stopped_at_the_context(model, tmp_path, monkeypatch, kvsnap_home):
    from kvsnap.engine import runner as runner_mod

    counter = iter(range(10**6))
    # Tokens that neither end the turn nor repeat: the answer runs until the context is full.
    monkeypatch.setattr(runner_mod, "sample", lambda logits, params, generator: 40 + next(counter) % 200)
    args = ["chat", "--model", model, "--device", "cpu", "--temperature", "0", "--ctx-size", "64"]
    result = runner.invoke(app, [*args, "--max-new-tokens", "500"], input="hello\n")
    assert result.exit_code == 0, result.output
    assert "stop_reason context]" in result.stderr


def test_the_view_is_recorded_and_checked_like_the_messages(tmp_path):
    messages = [{"role": "system", "content": "s"}, *({"role": r, "content": r} for r in ("user", "assistant") * 2)]
    w = write_test_snapshot(tmp_path / "ok.kv", num_tokens=9, messages=messages, extra={"dropped_messages": 2})
    with Snapshot(w.path) as snap:
        assert snap.meta.dropped_messages == 2
    for bad, msgs in ((len(messages), messages), (-1, messages), (True, messages), ("2", messages), (1, None)):
        with pytest.raises(SaveError, match="dropped_messages"):
            write_test_snapshot(tmp_path / "bad.kv", num_tokens=9, messages=msgs, extra={"dropped_messages": bad})
    assert not (tmp_path / "bad.kv").exists()
    # The reader refuses what the writer refuses (a file written by something else).
    rewrite_meta(w.path, lambda meta: meta["extra"].update(dropped_messages=len(messages)))
    with pytest.raises(SnapshotError, match="dropped_messages does not fit the chat messages"):
        Snapshot(w.path).close()
