"""What the CLI tells its user: progress without a terminal, readable plans, versions, help, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from core_helpers import kvsnap_imports
from typer.testing import CliRunner

from kvsnap_cli import ui
from kvsnap_cli.main import app

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


def base(model: str) -> list[str]:
    return ["--model", model, "--device", "cpu", "--block-size", "16"]


def test_long_prefill_reports_progress_without_a_terminal(model, monkeypatch):
    """Guards silence: a 6k-token prefill printed nothing for 11-34 s when output was not a terminal."""
    monkeypatch.setattr(ui, "LOG_EVERY_S", 0.0)
    result = invoke("run", *base(model), "--prompt", "word " * 280, "--chunk-size", "256", "--max-new-tokens", "0")
    assert result.exit_code == 0, result.output
    assert "prefill: 256/" in result.stderr and "prefill: 512/" in result.stderr


def test_conversion_stages_repeat_in_a_log(monkeypatch):
    """A counter that keeps moving is shown every few seconds in a log, not only its first value."""
    monkeypatch.setattr(ui, "LOG_EVERY_S", 0.0)
    shown = []
    monkeypatch.setattr(ui, "note", shown.append)
    with ui.status("converting") as update:
        for i in (16, 32, 48):
            update(f"converting x.gguf (one time): {i}/272 tensors")
    assert len(shown) == 3


def test_inspect_prompt_plan_reads_as_a_sentence(model, tmp_path):
    """Guards "1 hit (50.0%, 1 blocks to read), 1 to prefill in 1 chunks [1] (backs off one token ...)"."""
    snap = tmp_path / "s.kv"
    ok = invoke("run", *base(model), "--prompt", "alpha beta gamma", "--max-new-tokens", "0", "--save", str(snap))
    assert ok.exit_code == 0, ok.output
    shown = invoke("inspect", str(snap), "--prompt", "alpha beta gamma")
    assert shown.exit_code == 0, shown.output
    line = next(x for x in shown.stdout.splitlines() if x.startswith("prompt"))
    assert "1 blocks" not in line and "1 chunks" not in line
    assert "reused from the snapshot" in line and "read from 1 block)" in line
    assert "the whole prompt is in the snapshot" in line
    data = json.loads(invoke("inspect", str(snap), "--prompt", "alpha beta gamma", "--json").stdout)
    assert data["hit_tokens"] + data["prefill_tokens"] == data["prompt_tokens"]


def test_run_says_one_chunk_not_one_chunks(model):
    result = invoke("run", *base(model), "--prompt", "short prompt", "--max-new-tokens", "1", "--temperature", "0")
    assert result.exit_code == 0, result.output
    assert "in 1 chunk," in result.stderr and "1 chunks" not in result.stderr


def test_version_and_help():
    """Guards: no `kvsnap --version`; plain flags showed as `<bool>` in help; the chat help had a stray line break."""
    version = invoke("--version")
    assert version.exit_code == 0 and version.stdout.startswith("kvsnap ")
    for command, flag in (("run", "--chat"), ("run", "--json"), ("chat", "--force"), ("inspect", "--verify")):
        line = next(x for x in invoke(command, "--help").stdout.splitlines() if f" {flag} " in x)
        assert "<bool>" not in line
    chat_help = " ".join(invoke("chat", "--help").stdout.split())
    assert "One message per line, from a terminal or a pipe; /exit or end of input ends the chat" in chat_help


def test_usage_errors_come_before_the_model_loads(tmp_path):
    """Guards slow errors: a missing --resume file or --prompt-file was reported after a 4 s model load.
    The model named here does not exist, so reaching the load would give another error."""
    missing = tmp_path / "nope"
    for args, expected in (
        (["--prompt-file", str(missing)], "no such prompt file"),
        (["--prompt", "x", "--resume", str(missing)], "no such snapshot to resume"),
    ):
        result = invoke("run", "--model", str(tmp_path / "no-model"), *args)
        assert result.exit_code == 1 and expected in result.stderr, result.output


def test_run_without_a_prompt_answers_without_torch_or_a_model():
    """`kvsnap run` with no prompt says what is missing before it imports torch or loads a model
    (how fast that is, benchmarks/startup.py measures; a test on a shared machine cannot)."""
    out, imported = kvsnap_imports("run", cwd=ROOT)
    assert out.returncode == 1 and "torch" not in imported, out.stderr[-2000:]
    assert "give --prompt" in out.stderr and "loading" not in out.stderr


def test_a_snapshot_of_another_model_names_both(tiny_model_dir, tmp_path):
    """Guards "written for a cache of 2 layers x 2 kv heads x 4 (float32), this model has 30 layers..."
    without naming either model."""
    snap = tmp_path / "s.kv"
    llama, qwen = str(tiny_model_dir("llama")), str(tiny_model_dir("qwen2"))
    assert invoke("run", *base(llama), "--prompt", "hello", "--max-new-tokens", "0", "--save", str(snap)).exit_code == 0
    result = invoke("run", *base(qwen), "--prompt", "hello", "--resume", str(snap))
    assert result.exit_code == 1
    assert "another model" in result.stderr and llama in result.stderr and qwen in result.stderr


def test_a_text_file_given_as_a_snapshot_is_called_what_it_is(tmp_path):
    """Guards a misleading error: a text file as a snapshot said "...header too large); truncated?"."""
    text = tmp_path / "notes.kv"
    text.write_text("just some notes, not a snapshot\n" * 20)
    result = invoke("inspect", str(text))
    assert result.exit_code == 1
    assert "not a kvsnap snapshot" in result.stderr and "truncated" not in result.stderr


def test_a_bad_json_line_has_no_made_up_id_and_one_position(model, tmp_path):
    """Guards `"id": 2` for a line that has no id, and "line 2: ... (char 51))" with two positions."""
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"id": "a", "prompt": "x", "max_new_tokens": 1}\n{"prompt": "y", oops}\n')
    result = invoke("run", *base(model), "--batch", str(jobs))
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert rows[1]["id"] is None
    assert rows[1]["error"] == "line 2: not valid JSON (Expecting property name enclosed in double quotes at column 17)"
