"""Every script in examples/ runs: on a tiny model by default, on the real default model when slow tests run.

Each runs as ``__main__`` in this process (``runpy``), with its own command line, as ``python
examples/NAME.py ARGS`` would run it: no new interpreter importing torch again for each script.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import real_model_home

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def run_example(run_script):
    """``run_example(NAME, *ARGS, home=KVSNAP_HOME)``: the script's standard output; it must not fail."""

    def run(name: str, *args: str, home: Path) -> str:
        ran = run_script(ROOT / "examples" / name, *args, env={"KVSNAP_HOME": str(home)})
        assert ran.returncode == 0, ran.stderr[-2000:]
        return ran.stdout

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
