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
