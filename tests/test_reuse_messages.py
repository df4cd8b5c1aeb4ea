"""What the CLI says about reuse: the cause of a miss names a system message the template put in and a
load-or-recompute decision; a chat job's snapshot records its conversation; a recomputing resume says
so instead of "resumed 0 tokens"; notes never run on into the streamed answer."""

from __future__ import annotations

import json

import pytest
from cli_helpers import kvsnap
from typer.testing import CliRunner

from kvsnap.engine import costs
from kvsnap.format import Snapshot
from kvsnap.reuse import CostModel
from kvsnap_cli.main import app

runner = CliRunner()
QUESTION = "What is the capital of France? Answer in one word please."


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


def run(model: str, *args: str):
    base = ["run", "--model", model, "--device", "cpu", "--block-size", "16", "--max-new-tokens", "3"]
    return runner.invoke(app, [*base, *args])


def test_a_run_chat_snapshot_records_its_conversation(model, tmp_path):
    snap = tmp_path / "c.kv"
    out = run(model, "--chat", "--system", "You are terse.", "--prompt", QUESTION, "--save", str(snap), "--json")
    assert out.exit_code == 0, out.output
    answer = json.loads(out.stdout)["text"]
    with Snapshot(snap) as s:
        messages = s.meta.messages
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    assert messages[0]["content"] == "You are terse." and messages[2]["content"] == answer


def test_a_missing_system_message_is_named_as_the_cause(model, tmp_path):
    snap = tmp_path / "c.kv"
    primed = run(model, "--chat", "--system", "You are terse.", "--prompt", QUESTION, "--save", str(snap))
    assert primed.exit_code == 0, primed.output
    # No --system now: the template writes its own default system prompt where the snapshot has another.
    out = run(model, "--chat", "--prompt", QUESTION, "--resume", str(snap), "--explain", "--json")
    assert out.exit_code == 0, out.output
    miss = json.loads(out.stdout)["miss"]
    assert miss["cause"] == "system", miss


def test_a_recompute_decision_is_named_by_explain_and_the_stats(model, tmp_path):
    snap = tmp_path / "d.kv"
    primed = " ".join(["one two three"] * 20)
    assert run(model, "--prompt", primed, "--max-new-tokens", "0", "--save", str(snap)).exit_code == 0
    longer = primed + " four five six"
    out = run(model, "--prompt", longer, "--resume", str(snap), "--reuse", "recompute", "--explain", "--json")
    miss = json.loads(out.stdout)["miss"]
    assert miss["cause"] == "reuse" and "--reuse recompute" in miss["why"], miss
    shown = run(model, "--prompt", longer, "--resume", str(snap), "--reuse", "recompute")
    assert "recomputed, not loaded: --reuse recompute" in shown.stderr


def test_an_auto_decision_to_recompute_gives_its_reason(model, tmp_path, monkeypatch):
    snap = tmp_path / "d.kv"
    assert run(model, "--prompt", "one two three " * 20, "--max-new-tokens", "0", "--save", str(snap)).exit_code == 0
    cheap = CostModel("", ((64, 1e-9), (1024, 1e-8)), 1.0, 1.0)  # recomputing is all but free here
    monkeypatch.setattr(costs, "cached", lambda lm: cheap)
    shown = run(model, "--prompt", "one two three " * 21, "--resume", str(snap))
    assert shown.exit_code == 0, shown.output
    assert "recomputed, not loaded: predicted load" in shown.stderr


def test_a_chat_resumed_with_reuse_recompute_says_what_happens(model, tmp_path):
    snap = tmp_path / "chat.kv"
    args = ["chat", "--model", model, "--device", "cpu", "--block-size", "16"]
    args += ["--temperature", "0", "--max-new-tokens", "4", "--resume", str(snap)]
    first = kvsnap(*args, input="hello there\n")
    assert first.returncode == 0, first.stderr
    again = kvsnap(*args, "--reuse", "recompute", input="and again\n")
    assert again.returncode == 0, again.stderr
    assert "resumed 0 tokens" not in again.stderr
    assert "recomputed on the next turn, not loaded (--reuse recompute)" in again.stderr


def test_a_refused_snapshot_note_starts_on_its_own_line(model, tmp_path):
    bad = tmp_path / "bad.kv"
    bad.write_bytes(b"not a snapshot at all")
    out = run(model, "--prompt", "hello", "--resume", str(bad), "--on-mismatch", "recompute", "--max-new-tokens", "4")
    assert out.exit_code == 0, out.output
    assert out.stdout.endswith("\n")  # the streamed answer is ended before any note follows
    assert "\nsnapshot refused" in "\n" + out.output.split(out.stdout.rstrip("\n"), 1)[-1]
