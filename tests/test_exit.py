"""A finished CLI process ends without the interpreter's teardown (kvsnap_cli.startup.leave), and loses nothing.

What a user relies on: every byte of the output (a pipe or a file is block-buffered), the exit code,
the files a command wrote, and the ``atexit`` clean-up; and that a process with work still running
in a thread of its own exits the normal way, after that work.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# An object whose finalizer runs in the interpreter's teardown, and so shows whether it ran.
_SCRIPT = """
import atexit, pathlib, sys, threading
from kvsnap_cli import startup

class Loud:
    def __del__(self):
        sys.stderr.write("teardown ran\\n")

kept = Loud()
startup.own_process = True
atexit.register(pathlib.Path(sys.argv[1]).write_text, "atexit ran")
if sys.argv[2] == "busy":  # a thread of ours still working: the interpreter must join it
    gate = threading.Event()
    threading.Thread(target=gate.wait, args=(2,)).start()
sys.stdout.write("x" * 200_000)  # block-buffered into a pipe: lost unless flushed
startup.leave(3)
sys.stdout.write("|returned")
sys.exit(4)
"""


def _run(tmp_path: Path, mode: str) -> tuple[subprocess.CompletedProcess, Path]:
    marker = tmp_path / f"atexit-{mode}"
    cmd = [sys.executable, "-c", _SCRIPT, str(marker), mode]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60), marker


def test_leave_skips_the_teardown_but_flushes_runs_atexit_and_keeps_the_code(tmp_path):
    proc, marker = _run(tmp_path, "idle")
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "x" * 200_000
    assert marker.read_text() == "atexit ran"
    assert "teardown ran" not in proc.stderr  # the teardown was skipped: that is the point


def test_leave_returns_while_a_thread_of_ours_still_works(tmp_path):
    proc, marker = _run(tmp_path, "busy")
    assert proc.returncode == 4, proc.stderr  # the normal exit, after the thread ended
    assert proc.stdout == "x" * 200_000 + "|returned"
    assert marker.read_text() == "atexit ran" and "teardown ran" in proc.stderr


def test_leave_is_a_no_op_outside_the_cli_process():
    from kvsnap_cli import startup

    assert not startup.own_process  # tests run commands in-process: never end pytest's interpreter
    startup.leave(0)


# The CLI as `kvsnap` runs it, with a finalizer that shows whether the interpreter's teardown ran.
_CLI = """
import sys

class Loud:
    def __del__(self):
        sys.stderr.write("teardown ran\\n")

kept = Loud()
from kvsnap_cli.main import main
sys.argv = ["kvsnap", *sys.argv[1:]]
main()
"""


def test_real_commands_exit_fast_with_their_output_their_files_and_their_codes(tiny_model_dir, kvsnap_home, tmp_path):
    model, snap = str(tiny_model_dir("llama")), tmp_path / "s.kv"
    env = {"KVSNAP_HOME": str(kvsnap_home), "PATH": "/usr/bin:/bin"}

    def kvsnap(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-c", _CLI, *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
        assert "teardown ran" not in proc.stderr, proc.stderr  # every one of them took the fast exit
        return proc

    prompt = ("--model", model, "--prompt", "alpha beta gamma delta " * 20, "--block-size", "16")
    ran = kvsnap("run", *prompt, "--max-new-tokens", "3", "--json", "--save", str(snap))
    assert ran.returncode == 0, ran.stderr
    row = json.loads(ran.stdout)
    assert row["prompt_tokens"] > 32 and row["new_tokens"] == 3
    shown = kvsnap("inspect", str(snap), "--json")  # the file the run wrote is whole
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["tokens"] == row["prompt_tokens"] + 3  # the prompt and the answer
    # A resume: the snapshot read and decoded in a prefetch thread and the decode pool, then the fast exit.
    resumed = kvsnap("run", *prompt, "--max-new-tokens", "2", "--json", "--resume", str(snap), "--reuse", "load")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["hit_tokens"] >= 32
    assert kvsnap("run", "--model", model).returncode == 1  # an error: no prompt
    assert kvsnap("run", "--no-such-flag").returncode == 2  # a usage error


@pytest.mark.parametrize("fd", [1, 2])
def test_a_closed_output_leaves_the_exit_to_the_interpreter(fd):
    # `kvsnap --version >&-`: Python starts with sys.stdout None; the exit code is the command's.
    cmd = [sys.executable, "-m", "kvsnap_cli.main", "--version"]
    proc = subprocess.run(cmd, cwd=ROOT, preexec_fn=lambda: os.close(fd), capture_output=False, timeout=60)
    assert proc.returncode == 0
