"""A chat that outgrows its context stays open: the oldest turns leave the model's view, the conversation
(and its file) keeps them, and a resumed chat shows the model the same turns.

Tiny random-weight model, greedy, a small --ctx-size; chats run as subprocesses with stdin piped.
"""

from __future__ import annotations

import json
import os
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
