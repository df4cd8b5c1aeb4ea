"""The kvsnap CLI as users drive it: typer's CliRunner in-process; a new process where what it imports is the point."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import Ran, kvsnap
from core_helpers import kvsnap_imports
from typer.testing import CliRunner

from kvsnap_cli.main import app

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
DOC = "Blocks of tokens are hashed in a chain, so a prefix is found by its last block alone. " * 6


def invoke(*args: str, input: str | None = None):
    return runner.invoke(app, list(args), input=input)


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


def base(model: str) -> list[str]:
    # --reuse load: these tests are about what a reused prefix gives. Under --reuse auto a calibration
    # taken on a busy machine may find recomputing the tiny model's prefix faster (tests/test_reuse.py
    # covers that decision), and then nothing is reused.
    return ["--model", model, "--device", "cpu", "--block-size", "16", "--chunk-size", "32", "--reuse", "load"]


@pytest.mark.parametrize("command", ["chat", "run", "inspect", "pull"])
def test_every_command_has_help(command):
    result = invoke(command, "--help")
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["chat", "--help"]], ids=" ".join)
def test_help_does_not_import_torch(args):
    """`kvsnap --help` and a command's help, in a new process as a user starts them, show the help
    without importing torch (the import list comes from ``-X importtime``)."""
    proc, imported = kvsnap_imports(*args, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Usage" in proc.stdout
    assert not {"torch", "transformers"} & imported


def test_run_resume_reuses_prefix_and_matches_cold_output(model, tmp_path):
    snap = tmp_path / "doc.kv"
    prime = invoke("run", *base(model), "--prompt", DOC, "--max-new-tokens", "0", "--save", str(snap), "--json")
    assert prime.exit_code == 0, prime.output
    primed = json.loads(prime.stdout)
    assert primed["hit_tokens"] == 0 and primed["text"] == "" and snap.exists()

    question = " What is hashed?"
    args = ["run", *base(model), "--prompt", DOC + question, "--max-new-tokens", "8", "--temperature", "0", "--json"]
    cold = json.loads(invoke(*args).stdout)
    resumed_result = invoke(*args, "--resume", str(snap))
    assert resumed_result.exit_code == 0, resumed_result.output
    resumed = json.loads(resumed_result.stdout)
    for key in ("prompt_tokens", "hit_tokens", "prefill_tokens", "reuse_ratio", "chunks", "text", "ttft_s"):
        assert key in resumed
    assert resumed["prompt_tokens"] == cold["prompt_tokens"]
    assert resumed["hit_tokens"] >= primed["prompt_tokens"] - 2  # a BPE merge may move the boundary
    assert resumed["prefill_tokens"] == resumed["prompt_tokens"] - resumed["hit_tokens"]
    assert resumed["prefill_tokens"] < cold["prefill_tokens"] / 4
    assert resumed["text"] == cold["text"]


def test_run_and_chat_resume_decode_the_snapshot_while_the_model_loads(model, tmp_path, monkeypatch, kvsnap_home):
    from kvsnap.engine import restore as restoring
    from kvsnap.format import prefetch

    snap = tmp_path / "doc.kv"
    assert invoke("run", *base(model), "--prompt", DOC, "--max-new-tokens", "0", "--save", str(snap)).exit_code == 0
    args = ["run", *base(model), "--prompt", DOC + " Why?", "--max-new-tokens", "4", "--temperature", "0", "--json"]
    plain = json.loads(invoke(*args, "--resume", str(snap)).stdout)
    prefetch.discard()

    def refuse(*a, **k):
        raise AssertionError("the snapshot was read again after the model loaded")

    monkeypatch.setattr(restoring, "_read_blocks", refuse)  # only the prefetched blocks can be used
    fetched = invoke(*args, "--resume", str(snap))
    assert fetched.exit_code == 0, fetched.output
    fetched = json.loads(fetched.stdout)
    assert (fetched["text"], fetched["hit_tokens"]) == (plain["text"], plain["hit_tokens"]) and plain["hit_tokens"] > 0
    chat = invoke("chat", *base(model), "--resume", str(snap), "--save", str(tmp_path / "c.kv"), input="Hi\n")
    assert chat.exit_code == 0, chat.output
    assert prefetch._jobs == {}  # every prefetch was claimed


def test_run_prompt_file_then_prompt(model, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    snap = tmp_path / "doc.kv"
    assert (
        invoke("run", *base(model), "--prompt-file", str(doc), "--max-new-tokens", "0", "--save", str(snap)).exit_code
        == 0
    )
    result = invoke(
        "run", *base(model), "--prompt-file", str(doc), "--prompt", " Q?", "--resume", str(snap), "--json",
        "--max-new-tokens", "2",
    )  # fmt: skip
    row = json.loads(result.stdout)
    assert row["hit_tokens"] > 0.8 * row["prompt_tokens"]


def test_inspect_json_and_prompt(model, tmp_path):
    snap = tmp_path / "s.kv"
    invoke("run", *base(model), "--prompt", DOC, "--max-new-tokens", "0", "--save", str(snap))
    result = invoke("inspect", str(snap), "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    for key in ("model", "tokens", "blocks", "block_size", "kv_bytes", "file_bytes", "codec"):
        assert key in info
    assert info["block_size"] == 16 and info["blocks"] == -(-info["tokens"] // 16)
    assert info["file_bytes"] == snap.stat().st_size

    hit = json.loads(invoke("inspect", str(snap), "--json", "--prompt", DOC + " more").stdout)
    assert hit["hit_tokens"] >= info["tokens"] - 2 and hit["prefill_tokens"] == hit["prompt_tokens"] - hit["hit_tokens"]
    plain = invoke("inspect", str(snap), "--verify")
    assert plain.exit_code == 0 and "all blocks verified" in plain.stdout


def test_inspect_does_not_import_torch(model, tmp_path):
    snap = tmp_path / "s.kv"
    invoke("run", *base(model), "--prompt", DOC, "--max-new-tokens", "0", "--save", str(snap))
    code = (
        "import sys; from kvsnap_cli.main import app\n"
        f"try:\n    app(['inspect', {str(snap)!r}, '--json', '--prompt', 'Blocks'])\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=os.environ)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["hit_tokens"] > 0


def test_damaged_file_is_one_line_error_exit_1(model, tmp_path):
    bad = tmp_path / "bad.kv"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    for args in (["inspect", str(bad)], ["run", *base(model), "--prompt", "hi", "--resume", str(bad)]):
        result = invoke(*args)
        assert result.exit_code == 1, result.output
        assert "Traceback" not in result.output
        notes = ("loading", "calibrating")  # progress lines, not errors
        lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith(notes)]
        assert len(lines) == 1 and "error" in lines[0].lower() and "bad.kv" in lines[0], result.stderr


def test_snapshot_of_another_model_is_refused(tiny_model_dir, tmp_path):
    snap = tmp_path / "llama.kv"
    llama = str(tiny_model_dir("llama"))
    invoke("run", *base(llama), "--prompt", DOC, "--max-new-tokens", "0", "--save", str(snap))
    result = invoke("run", *base(str(tiny_model_dir("qwen2"))), "--prompt", DOC, "--resume", str(snap))
    assert result.exit_code == 1
    assert "written for" in result.stderr


def test_usage_errors_exit_2():
    assert invoke("run", "--max-new-tokens", "-1", "--prompt", "x").exit_code == 2
    assert invoke("run", "--no-such-flag").exit_code == 2


def test_missing_prompt_is_user_error(model):
    result = invoke("run", *base(model))
    assert result.exit_code == 1 and "--prompt" in result.stderr


def test_batch_rows_in_order_and_bad_jobs_do_not_stop_it(model, tmp_path):
    snap = tmp_path / "doc.kv"
    invoke("run", *base(model), "--prompt", DOC, "--max-new-tokens", "0", "--save", str(snap))
    jobs = tmp_path / "jobs.jsonl"
    rows = [
        json.dumps({"id": "a", "prompt": DOC + " one", "max_new_tokens": 3}),
        "{this is not json",
        json.dumps({"id": "c", "prompt": "x", "resume": str(tmp_path / "missing.kv")}),
        json.dumps({"id": "d", "messages": [{"role": "user", "content": "hello"}], "max_new_tokens": 2}),
        json.dumps({"id": "e", "prompt": DOC + " two", "save": str(tmp_path / "e.kv"), "max_new_tokens": 2}),
    ]
    jobs.write_text("\n".join(rows) + "\n")
    result = invoke("run", *base(model), "--batch", str(jobs), "--resume", str(snap), "--temperature", "0")
    assert result.exit_code == 1  # two jobs failed
    out = json_lines(result.stdout)
    assert [r["id"] for r in out] == ["a", None, "c", "d", "e"]  # no id can be read from a line that is not JSON
    assert "error" in out[1] and "JSON" in out[1]["error"]
    assert "error" in out[2] and "missing.kv" in out[2]["error"]
    assert out[0]["hit_tokens"] > 0 and out[0]["new_tokens"] <= 3
    assert out[3]["hit_tokens"] == 0  # the batch --resume is a different prefix: nothing to reuse
    assert out[4]["saved"]["tokens"] > 0 and (tmp_path / "e.kv").exists()


def _chat(model: str, session: Path, lines: str) -> Ran:
    """``kvsnap chat`` in this process, ``lines`` piped in."""
    args = ["chat", *base(model), "--resume", str(session), "--temperature", "0", "--max-new-tokens", "6"]
    return kvsnap(*args, input=lines)


def test_chat_over_stdin_autosaves_and_resumes_with_zero_recompute(model, tmp_path):
    session = tmp_path / "chat.kv"
    first = _chat(model, session, "hello there\n/stats\n")
    assert first.returncode == 0, first.stderr
    assert "does not exist yet" in first.stderr and "saved" in first.stderr
    assert session.exists()
    tokens = json.loads(invoke("inspect", str(session), "--json").stdout)["tokens"]

    second = _chat(model, session, "how are you\n/exit\nnever sent\n")
    assert second.returncode == 0, second.stderr
    assert f"resumed {tokens:,} tokens from {session} in" in second.stderr
    assert "(0 recomputed)" in second.stderr
    # The first turn's prompt is reused at least; the random model's answer may not re-tokenize
    # identically after the template renders it again, and only equal tokens may be reused.
    first_prompt = int(re.search(r"\[(\d+) prompt tokens", first.stderr).group(1))
    reused = int(re.search(r"prompt tokens: (\d+) reused", second.stderr).group(1))
    assert first_prompt <= reused <= tokens
    info = json.loads(invoke("inspect", str(session), "--json").stdout)
    assert info["chat_turns"] == 4  # two user turns, two answers; "never sent" came after /exit


def test_chat_slash_commands(model, tmp_path):
    other = tmp_path / "other.kv"
    result = _chat(model, tmp_path / "c.kv", f"/help\nhi\n/save {other}\n/reset\n/stats\n/bogus\n")
    assert result.returncode == 0, result.stderr
    assert "/save [FILE]" in result.stderr and other.exists()
    assert "conversation reset" in result.stderr and "0 tokens in the session" in result.stderr
    assert "native forward, packed weights" in result.stderr  # a chat packs its weights while the user types
    assert "unknown command /bogus" in result.stderr


def test_chat_stats_counts_the_tokens_a_save_holds(model, tmp_path):
    result = _chat(model, tmp_path / "c.kv", "hi\n/stats\n")
    assert result.returncode == 0, result.stderr
    saved = int(re.search(r"saved (\d+) tokens to", result.stderr).group(1))
    assert f"\n{saved} tokens in the session (1 turn) + 1 answer token the next message runs first" in result.stderr


def test_chat_says_an_autosave_before_reading_the_next_message(model, tmp_path, monkeypatch):
    """In a terminal the line of an autosave came under the message typed next; it comes before the prompt."""
    import builtins

    from kvsnap_cli import ui

    events: list[str] = []
    note, read = ui.note, builtins.input
    monkeypatch.setattr(ui, "note", lambda message: (events.append(message), note(message)))
    monkeypatch.setattr(builtins, "input", lambda prompt="": (events.append("<input>"), read(prompt))[1])
    args = [*base(model), "--resume", str(tmp_path / "c.kv"), "--temperature", "0", "--max-new-tokens", "4"]
    result = runner.invoke(app, ["chat", *args], input="hi\nagain\n")
    assert result.exit_code == 0, result.output
    reads = [i for i, e in enumerate(events) if e == "<input>"]
    saves = [i for i, e in enumerate(events) if e.startswith("saved ")]
    assert len(reads) == 3 and len(saves) == 2
    assert reads[0] < saves[0] < reads[1] < saves[1] < reads[2]


def test_chat_save_failure_keeps_the_chat_going(model, tmp_path):
    """Guards a crash: a /save into a missing folder raised a traceback and ended the conversation."""
    result = _chat(model, tmp_path / "c.kv", f"hi\n/save {tmp_path}/missing/x.kv\nstill here\n/stats\n")
    assert result.returncode == 0, result.stderr
    assert "cannot save" in result.stderr and "Traceback" not in result.stderr
    assert "(2 turns)" in result.stderr  # the message after the failed save was answered


def test_batch_bad_numbers_are_rows_not_crashes(model, tmp_path):
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(
        '{"id": "nan", "prompt": "x", "max_new_tokens": NaN}\n'
        '{"id": "big", "prompt": "x", "seed": 1e20}\n'
        '{"id": "temp", "prompt": "x", "temperature": NaN}\n'
        '{"id": "chat", "prompt": "x", "chat": "no"}\n'
        '{"id": "ok", "prompt": "x", "max_new_tokens": 1}\n'
    )
    result = invoke("run", *base(model), "--batch", str(jobs))
    assert result.exit_code == 1 and "Traceback" not in result.output
    rows = json_lines(result.stdout)
    assert [r["id"] for r in rows] == ["nan", "big", "temp", "chat", "ok"]
    assert all("error" in r for r in rows[:4]) and "error" not in rows[4]


def test_batch_refuses_flags_it_would_ignore(model, tmp_path):
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"prompt": "x"}\n')
    for flag in (["--save", str(tmp_path / "o.kv")], ["--chat"], ["--system", "s"]):
        result = invoke("run", *base(model), "--batch", str(jobs), *flag)
        assert result.exit_code == 1 and "per job" in result.stderr


def test_save_into_a_missing_folder_fails_before_the_model_loads(model, tmp_path):
    result = invoke("run", *base(model), "--prompt", "x", "--save", str(tmp_path / "no" / "x.kv"))
    assert result.exit_code == 1 and "does not exist" in result.stderr and "loading" not in result.stderr


def test_inspect_finds_the_tokenizer_of_a_model_named_by_a_relative_path(tiny_model_dir, tmp_path, monkeypatch):
    model = tiny_model_dir("llama")
    monkeypatch.chdir(model.parent)
    snap = tmp_path / "rel.kv"
    assert invoke("run", "--model", f"./{model.name}", "--device", "cpu", "--prompt", DOC, "--max-new-tokens", "0",
                  "--save", str(snap)).exit_code == 0  # fmt: skip
    monkeypatch.chdir(tmp_path)  # "./llama" means nothing here; the recorded folder still does
    info = json.loads(invoke("inspect", str(snap), "--json", "--prompt", DOC).stdout)
    assert info["preview_start"] and info["hit_tokens"] > 0


@pytest.mark.parametrize("command", ["chat", "run"])
def test_help_fits_a_screen_and_help_all_documents_every_option(command):
    from typer.main import get_command

    short = runner.invoke(app, [command, "--help"], env={"COLUMNS": "80"})
    assert short.exit_code == 0, short.output
    lines = short.output.splitlines()
    assert len(lines) <= 60, short.output
    wrapped = [line for line in lines if line.startswith("│") and not line[1:].lstrip().startswith(("-", "│"))]
    assert wrapped == [], "every option's help is one line"
    full = runner.invoke(app, [command, "--help-all"], env={"COLUMNS": "80"})
    assert full.exit_code == 0, full.output
    assert "Advanced" in full.output and "Advanced" not in short.output
    options = [p for p in get_command(app).commands[command].params if p.param_type_name == "option"]
    assert len(options) > 20
    for option in options:
        assert option.help, option.name
        assert option.opts[0] in full.output, option.opts[0]


def test_version_has_a_short_flag_and_the_shell_completes_commands(monkeypatch):
    assert invoke("-V").stdout == invoke("--version").stdout == f"kvsnap {__import__('kvsnap').__version__}\n"
    env = {"_KVSNAP_COMPLETE": "complete_bash", "COMP_WORDS": "kvsnap mod", "COMP_CWORD": "1"}
    completed = runner.invoke(app, [], env=env, prog_name="kvsnap")
    assert completed.stdout.split() == ["models"]
    # --show-completion detects the shell from the process tree: a run with no shell above it (a detached
    # CI job) would find none. The user's shell here is bash.
    monkeypatch.setattr("shellingham.detect_shell", lambda *args, **kwargs: ("bash", "/bin/bash"))
    shown = invoke("--show-completion")
    assert shown.exit_code == 0 and "_KVSNAP_COMPLETE=complete_bash" in shown.stdout
