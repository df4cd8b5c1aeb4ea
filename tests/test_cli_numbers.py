"""``kvsnap run`` never answers a number, a vanished working folder or a closed stdout with a
traceback: an answer, or one line and exit 1 (typer's usage errors: exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvsnap_cli.main import app

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


def run(model: str, *args: str):
    return runner.invoke(app, ["run", "--model", model, "--device", "cpu", "--prompt", "Once upon", *args])


def no_traceback(result) -> None:
    assert result.exit_code in (0, 1, 2), (result.exit_code, result.output)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    if result.exit_code == 1:
        assert len(result.output.strip().splitlines()) == 1, result.output


NUMBER_TEXT = st.one_of(
    st.integers(min_value=-(10**25), max_value=10**25).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.floats(min_value=0, max_value=1e-30).map(repr),
    st.sampled_from(["1e-38", "1e-46", "5e-324", "0", "-0.0", "1e400", "nan", "2e9", str(2**63), str(2**64), "x"]),
)
FLAGS = ("--temperature", "--top-p", "--top-k", "--max-new-tokens", "--seed")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.dictionaries(st.sampled_from(FLAGS), NUMBER_TEXT, min_size=1, max_size=3))
def test_any_number_on_the_command_line_is_an_answer_or_one_line(model, values):
    args = [x for flag, value in values.items() for x in (flag, value)]
    if "--max-new-tokens" not in values:
        args += ["--max-new-tokens", "3"]
    elif values["--max-new-tokens"].lstrip("-").isdigit() and int(values["--max-new-tokens"]) > 8:
        args += ["--ctx-size", "16"]  # a huge answer ends at the context
    no_traceback(run(model, *args))


@pytest.mark.parametrize("flags", [["--temperature", "1e-38"], ["--top-p", "1e-46", "--temperature", "1"]])
def test_vanishing_temperature_or_top_p_answers_greedily(model, flags):
    greedy = run(model, "--max-new-tokens", "4", "--temperature", "0", "--json")
    tiny = run(model, "--max-new-tokens", "4", "--seed", "3", "--json", *flags)
    no_traceback(tiny)
    assert tiny.exit_code == 0 and json.loads(tiny.stdout)["text"] == json.loads(greedy.stdout)["text"]


def _kvsnap(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "kvsnap_cli.main", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, **kwargs)


def _in_a_deleted_folder(folder: Path):
    """A ``preexec_fn``: the command starts in ``folder``, deleted under it."""
    folder.mkdir()

    def enter_and_delete() -> None:
        os.chdir(folder)
        os.rmdir(folder)

    return enter_and_delete


def test_save_from_a_deleted_working_folder_is_one_line(model, tmp_path):
    args = ["run", "--model", model, "--device", "cpu", "--prompt", "hi", "--max-new-tokens", "1", "--save", "x.kv"]
    proc = _kvsnap(args, preexec_fn=_in_a_deleted_folder(tmp_path / "gone"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "error: x.kv: cannot save there, the working folder no longer exists"


def test_a_closed_stdout_still_saves_without_a_traceback(model, tmp_path):
    snap = tmp_path / "closed.kv"
    args = ["run", "--model", model, "--device", "cpu", "--prompt", "hi", "--max-new-tokens", "2", "--save", str(snap)]
    proc = _kvsnap([*args, "--json"], preexec_fn=lambda: os.close(1))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert snap.exists()
