"""Every script in examples/ runs: on a tiny model by default, on the real default model when slow tests run.

Each runs as ``__main__`` in this process (``runpy``), with its own command line, as ``python
examples/NAME.py ARGS`` would run it: no new interpreter importing torch again for each script.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import real_model_home

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def run_example(monkeypatch, capsys):
    """``run_example(NAME, *ARGS, home=KVSNAP_HOME)``: the script's standard output; it must not fail."""

    def run(name: str, *args: str, home: Path) -> str:
        script = ROOT / "examples" / name
        with monkeypatch.context() as patched:
            patched.setenv("KVSNAP_HOME", str(home))
            patched.setattr(sys, "argv", [str(script), *args])
            capsys.readouterr()
            try:
                runpy.run_path(str(script), run_name="__main__")
            except SystemExit as exc:  # argparse and friends end the script this way
                assert exc.code in (None, 0), capsys.readouterr().err[-2000:]
        return capsys.readouterr().out

    return run


def test_batch_resume_then_inspect(run_example, tiny_model_dir, tmp_path, kvsnap_home):
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


def test_chat_api(run_example, tiny_model_dir, tmp_path, kvsnap_home):
    out = run_example(
        "chat_api.py", "--model", str(tiny_model_dir("llama")), "--out", str(tmp_path / "c.kv"), home=kvsnap_home
    )
    assert "resumed" in out and "2 messages" in out


@pytest.mark.slow
def test_chat_api_real_model(run_example, real_model_folder, tmp_path):
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
