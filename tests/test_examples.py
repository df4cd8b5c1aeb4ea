"""Every script in examples/ runs: on a tiny model by default, on the real default model when slow tests run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import real_model_home

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str, home: Path, env: dict[str, str] | None = None) -> str:
    env = {**os.environ, "KVSNAP_HOME": str(home), "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_batch_resume_then_inspect(tiny_model_dir, tmp_path, kvsnap_home):
    snap = tmp_path / "doc.kv"
    out = run_example(
        "batch_resume.py", "--model", str(tiny_model_dir("llama")), "--out", str(snap), "--max-new-tokens", "4",
        home=kvsnap_home,
    )  # fmt: skip
    assert out.startswith("primed ") and snap.exists()
    assert out.count("Q: ") == 3
    # Every question reuses the primed document and prefills only its own tail.
    for line in out.splitlines():
        if "prompt tokens" in line:
            prompt, reused = (int(x.split()[0]) for x in line.strip(" []").split(", ")[:2])
            assert reused > 0.8 * prompt

    info = run_example("inspect_snapshot.py", str(snap), "--prompt", "anything", home=kvsnap_home)
    assert "every block verifies" in info
    summary = json.loads(info.splitlines()[-1])
    assert summary["tokens"] > 0 and summary["file_bytes"] == snap.stat().st_size


def test_chat_api(tiny_model_dir, tmp_path, kvsnap_home):
    out = run_example(
        "chat_api.py", "--model", str(tiny_model_dir("llama")), "--out", str(tmp_path / "c.kv"), home=kvsnap_home
    )
    assert "resumed" in out and "2 messages" in out


@pytest.mark.slow
def test_chat_api_real_model(tmp_path):
    out = run_example("chat_api.py", "--out", str(tmp_path / "c.kv"), home=real_model_home())
    assert "Paris" in out and "Rome" in out


QUESTION = "\nQ: Who is the General Manager?\nA:"


def test_the_readme_asks_the_report_what_the_slow_test_below_runs():
    readme = (ROOT / "README.md").read_text()
    assert "--prompt-file examples/report.txt --prompt $'\\nQ: Who is the General Manager?\\nA:' \\" in readme
    assert "--resume doc.kv --stop $'\\n' --json" in readme


def kvsnap(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVSNAP_HOME": str(home), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "kvsnap_cli.main", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)


@pytest.mark.slow
def test_the_readme_document_questions_stop_after_the_answer(tmp_path):
    """Guards the README's example: its answers ran on into `A:` lines the model wrote itself."""
    home, doc = real_model_home(), str(tmp_path / "doc.kv")
    report = ["--prompt-file", "examples/report.txt", "--reuse", "load"]
    primed = kvsnap("run", *report, "--save", doc, "--max-new-tokens", "0", home=home)
    assert primed.returncode == 0, primed.stderr[-2000:]
    asked = kvsnap("run", *report, "--prompt", QUESTION, "--resume", doc, "--stop", "\n", "--json", home=home)
    assert asked.returncode == 0, asked.stderr[-2000:]
    row = json.loads(asked.stdout)
    assert row["stop_reason"] == "stop" and "Okafor" in row["text"] and "\n" not in row["text"]
    # Without a stop the answer still ends well before run's 256 tokens: the model repeats its line.
    free = json.loads(kvsnap("run", *report, "--prompt", QUESTION, "--resume", doc, "--json", home=home).stdout)
    assert free["stop_reason"] in ("repetition", "eos") and free["new_tokens"] < 256
