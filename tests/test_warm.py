"""A warm process (cli.warm, cli.warm_server): ``kvsnap run`` handed to a preloaded process is the same run.

What a user relies on: the output, files and exit code of a run it takes are those of the same run
in a new process; ^C reaches the run; a run whose ``kvsnap`` dies does not run on; a run it cannot
take (another environment, a dead socket, a folder not the user's) runs in its own process as before,
without a hang; it goes away when idle or asked, leaving nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from cli import warm

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "alpha beta gamma delta " * 20


@pytest.fixture(scope="module")
def runtime():
    # Short: a socket's path has ~100 bytes (pytest's tmp_path is longer).
    folder = Path(tempfile.mkdtemp(prefix="kvw"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def env(runtime, kvsnap_home):
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": str(kvsnap_home),
        "KVSNAP_HOME": str(kvsnap_home),
        "XDG_RUNTIME_DIR": str(runtime),
        "LANG": "C.UTF-8",
        "PYTHONPATH": str(ROOT),  # runs from another folder too (kvsnap need not be installed)
    }


@pytest.fixture
def own_env(env):
    """``env`` with a runtime folder of its own: no warm process but those the test starts."""
    folder = Path(tempfile.mkdtemp(prefix="kvo"))
    yield {**env, "XDG_RUNTIME_DIR": str(folder)}
    shutil.rmtree(folder, ignore_errors=True)


def kvsnap(env: dict, *args: str, input: str | None = None, **changes: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "cli.main", *args]
    run_env = {**env, **changes}
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=run_env, input=input, timeout=300)


def status(env: dict) -> list[dict]:
    proc = kvsnap(env, "warm", "status", "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["processes"]


def served(env: dict) -> int:
    return sum(p["served"] for p in status(env) if p["current"])


@pytest.fixture(scope="module")
def warm_up(env, tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    proc = kvsnap(env, "warm", "start", "--model", model, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    info = json.loads(proc.stdout)
    assert info["already"] is False and info["pid"] > 0
    assert info["tokenizers"] == [model]  # the runs below use its parse (tests/test_plain_tokenizer.py)
    yield info
    kvsnap(env, "warm", "stop")


@pytest.fixture(scope="module")
def primed(tiny_model_dir, tmp_path_factory, env):
    """A snapshot of the tiny model's prompt, made by a run in its own process."""
    snap = tmp_path_factory.mktemp("warm") / "doc.kv"
    model = str(tiny_model_dir("llama"))
    proc = kvsnap(env, "run", "--model", model, "--prompt", PROMPT, "--max-new-tokens", "0", "--save", str(snap),
                  KVSNAP_WARM="0")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return model, snap


def test_a_resumed_run_in_the_warm_process_equals_the_same_run_in_its_own(warm_up, primed, env, tmp_path):
    model, snap = primed
    ask = ("run", "--model", model, "--prompt", PROMPT + "epsilon zeta", "--resume", str(snap), "--json")
    before = served(env)
    here = kvsnap(env, *ask, "--save", str(tmp_path / "here.kv"), KVSNAP_WARM="0")
    there = kvsnap(env, *ask, "--save", str(tmp_path / "there.kv"))
    assert here.returncode == there.returncode == 0, here.stderr + there.stderr
    assert served(env) == before + 1  # the second one was the warm process's
    a, b = json.loads(here.stdout), json.loads(there.stdout)
    for field in ("text", "prompt_tokens", "hit_tokens", "prefill_tokens", "new_tokens", "stop_reason"):
        assert a[field] == b[field], field
    assert b["hit_tokens"] > 0 and b["prefill_tokens"] == b["prompt_tokens"] - b["hit_tokens"]
    saved = tmp_path / "there.kv"
    assert saved.stat().st_mode & 0o777 == 0o600  # made by the run, with its rules
    shown = kvsnap(env, "inspect", str(saved), "--json")
    assert json.loads(shown.stdout)["tokens"] == b["prompt_tokens"] + b["new_tokens"]


def test_streams_exit_codes_and_working_folder_are_the_runs(warm_up, primed, env, tmp_path):
    model, _ = primed
    before = served(env)
    missing = kvsnap(env, "run", "--model", model, "--prompt", "hi", "--resume", "nowhere.kv")
    assert missing.returncode == 1 and "nowhere.kv: no such snapshot" in missing.stderr
    usage = kvsnap(env, "run", "--no-such-flag")
    assert usage.returncode == 2 and "No such option" in usage.stderr
    jobs = '{"prompt": "alpha beta", "max_new_tokens": 2}\n{"prompt": "gamma", "max_new_tokens": 1}\n'
    batch = kvsnap(env, "run", "--model", model, "--batch", "-", input=jobs)  # stdin is the run's
    assert batch.returncode == 0, batch.stderr
    assert [json.loads(line)["new_tokens"] for line in batch.stdout.splitlines()] == [2, 1]
    # A relative path is the caller's folder's (the folder itself is handed over, not its name).
    cmd = [sys.executable, "-m", "cli.main", "run", "--model", model, "--prompt", "hi", "--max-new-tokens", "1",
           "--save", "rel.kv"]  # fmt: skip
    rel = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, timeout=300)
    assert rel.returncode == 0, rel.stderr
    assert (tmp_path / "rel.kv").stat().st_mode & 0o777 == 0o600
    assert served(env) == before + 4


def test_a_run_from_another_environment_or_context_runs_in_its_own_process(warm_up, primed, env, tmp_path):
    model, _ = primed
    hi = ("run", "--model", model, "--prompt", "hi", "--max-new-tokens", "1")
    before = served(env)
    proc = kvsnap(env, *hi, KVSNAP_DEBUG="0")  # a setting read at import
    assert proc.returncode == 0, proc.stderr
    off = kvsnap(env, *hi, KVSNAP_WARM="0")
    assert off.returncode == 0, off.stderr
    # Another niceness (or CPU set, limits, cgroup, namespaces): the warm process refuses, the run runs here.
    niced = subprocess.run(
        ["nice", "-n", "5", sys.executable, "-m", "cli.main", *hi], cwd=ROOT, env=env, capture_output=True, timeout=300
    )
    assert niced.returncode == 0, niced.stderr
    # An argument naming a descriptor of the caller's own: only 0-2 are handed over.
    (tmp_path / "p.txt").write_text("alpha beta")
    with open(tmp_path / "p.txt") as f:
        cmd = [sys.executable, "-m", "cli.main", "run", "--model", model, "--prompt-file", f"/dev/fd/{f.fileno()}"]
        named = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=300, pass_fds=(f.fileno(),))
    assert named.returncode == 0 or b"not a regular file" in named.stderr, named.stderr
    assert served(env) == before


def _start_batch(env: dict, model: str) -> subprocess.Popen:
    """A batch run from stdin, left waiting for its next job after answering a first one."""
    cmd = [sys.executable, "-m", "cli.main", "run", "--model", model, "--batch", "-"]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write('{"prompt": "alpha", "max_new_tokens": 1}\n')
    proc.stdin.flush()
    assert json.loads(proc.stdout.readline())["new_tokens"] == 1
    return proc


def _running(env: dict) -> int:
    return sum(p["running"] for p in status(env) if p["current"])


def test_interrupt_reaches_the_run_and_a_dead_caller_ends_it(warm_up, primed, env):
    model, _ = primed
    codes = []
    for where in ("1", "0"):  # in the warm process, then in its own
        proc = _start_batch({**env, "KVSNAP_WARM": where}, model)
        assert _running(env) == (1 if where == "1" else 0)
        time.sleep(1)  # blocked reading its next job
        proc.send_signal(signal.SIGINT)  # ^C, with the batch's input still open: only the signal ends it
        proc.wait(timeout=60)
        assert proc.stderr is not None and proc.stdin is not None
        err = proc.stderr.read()
        proc.stdin.close()
        codes.append((proc.returncode, "interrupted" in err, err[-300:]))
    assert [c[:2] for c in codes] == [(130, True)] * 2, codes
    proc = _start_batch(env, model)
    proc.kill()  # no chance to forward anything: the warm process sees the connection close
    proc.wait()
    deadline = time.monotonic() + 30
    while _running(env) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _running(env) == 0


def test_a_signal_the_caller_ignores_is_ignored_by_its_run(warm_up, primed, env):
    # `nohup kvsnap run ... &`: a hangup must not end the run, in the warm process as in its own.
    model, _ = primed
    cmd = [sys.executable, "-m", "cli.main", "run", "--model", model, "--batch", "-"]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN),
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write('{"prompt": "alpha", "max_new_tokens": 1}\n')
    proc.stdin.flush()
    assert json.loads(proc.stdout.readline())["new_tokens"] == 1
    assert _running(env) == 1
    proc.send_signal(signal.SIGHUP)
    time.sleep(1)
    proc.stdin.write('{"prompt": "beta", "max_new_tokens": 1}\n')  # still there: answers the next job
    proc.stdin.flush()
    assert json.loads(proc.stdout.readline())["new_tokens"] == 1
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err


def test_a_terminated_warm_process_ends_its_runs_and_says_how(own_env, primed):
    model, _ = primed
    started = kvsnap(own_env, "warm", "start", "--json")
    assert started.returncode == 0, started.stdout + started.stderr
    server = json.loads(started.stdout)["pid"]
    try:
        proc = _start_batch(own_env, model)
        assert _running(own_env) == 1
        os.kill(server, signal.SIGTERM)  # logout, shutdown: the runs get it too, and their kvsnap hears it
        proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGTERM
        assert proc.stderr is not None and "lost the warm process" not in proc.stderr.read()
        deadline = time.monotonic() + 30
        while _alive(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(server)
        assert list((Path(own_env["XDG_RUNTIME_DIR"]) / "kvsnap-warm").iterdir()) == []
    finally:
        _kill(server)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (reaped by init later) counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def test_a_dead_warm_process_leaves_runs_to_their_own_process_and_is_pruned(own_env, primed):
    model, _ = primed
    # A socket nobody listens on, under the runs' own key: what a killed warm process leaves.
    folder = Path(own_env["XDG_RUNTIME_DIR"]) / "kvsnap-warm"
    folder.mkdir(mode=0o700)
    dead = folder / f"{_key(own_env)}.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(dead))
    stale.close()
    proc = kvsnap(own_env, "run", "--model", model, "--prompt", "hi", "--max-new-tokens", "1")
    assert proc.returncode == 0, proc.stderr
    assert dead.exists()  # a run only reads the folder
    assert status(own_env) == [] and not dead.exists()  # pruned


def test_a_folder_that_is_not_the_users_alone_is_never_used(own_env, primed, tmp_path):
    model, _ = primed
    folder = Path(own_env["XDG_RUNTIME_DIR"]) / "kvsnap-warm"
    folder.mkdir()
    os.chmod(folder, 0o755)
    start = kvsnap(own_env, "warm", "start")
    assert start.returncode == 1 and "needs ours, 0700" in start.stderr, start.stderr
    # Someone listening there, under the runs' key: a run never even connects.
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(folder / f"{_key(own_env)}.sock"))
    listener.listen(1)
    listener.setblocking(False)
    run = kvsnap(own_env, "run", "--model", model, "--prompt", "hi", "--max-new-tokens", "1")
    assert run.returncode == 0, run.stderr
    with pytest.raises(BlockingIOError):
        listener.accept()
    listener.close()
    (folder / f"{_key(own_env)}.sock").unlink()
    folder.rmdir()
    folder.symlink_to(tmp_path)  # a link, even to a folder of ours: refused
    start = kvsnap(own_env, "warm", "start")
    assert start.returncode == 1 and "not a folder" in start.stderr, start.stderr


def test_a_warm_process_stopped_or_idle_leaves_nothing_behind(own_env):
    folder = Path(own_env["XDG_RUNTIME_DIR"]) / "kvsnap-warm"
    started = kvsnap(own_env, "warm", "start", "--json")
    assert started.returncode == 0, started.stdout + started.stderr
    first = json.loads(started.stdout)["pid"]
    try:
        again = kvsnap(own_env, "warm", "start", "--json")  # the one up is reported, not a second
        assert json.loads(again.stdout) | {"already": True} == json.loads(again.stdout)
        assert json.loads(again.stdout)["pid"] == first
        stopped = kvsnap(own_env, "warm", "stop", "--json")
        assert [p["pid"] for p in json.loads(stopped.stdout)["stopped"]] == [first]
        _wait_gone(first, folder)
    finally:
        _kill(first)
    started = kvsnap(own_env, "warm", "start", "--idle", "4", "--json")
    idle = json.loads(started.stdout)["pid"]
    try:
        _wait_gone(idle, folder)  # no run for 4 s: it went by itself
    finally:
        _kill(idle)
    nan = kvsnap(own_env, "warm", "start", "--idle", "nan")
    assert nan.returncode != 0 and list(folder.iterdir()) == []


def _wait_gone(pid: int, folder: Path) -> None:
    deadline = time.monotonic() + 60
    while (_alive(pid) or list(folder.iterdir())) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pid) and list(folder.iterdir()) == []  # its socket and lock are gone too


def _key(env: dict) -> str:
    """The key of runs in ``env`` (computed in such a process)."""
    code = "from cli import warm; print(warm.key())"
    probe = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    return probe.stdout.strip()


def test_the_key_follows_what_imports_fix(monkeypatch, tmp_path):
    base = warm.key()
    assert warm.key() == base
    monkeypatch.setenv("KVSNAP_PACK", "0")
    assert warm.key() != base
    monkeypatch.delenv("KVSNAP_PACK")
    monkeypatch.setenv("SOME_OTHER_VARIABLE", "1")  # not read at import: same processes
    assert warm.key() == base
    sources = tmp_path / "src"
    shutil.copytree(ROOT / "cli", sources / "cli", copy_function=shutil.copy2)
    shutil.copytree(ROOT / "kvsnap", sources / "kvsnap", copy_function=shutil.copy2)
    monkeypatch.setattr(warm, "_SOURCES", sources)
    copied = warm.key()
    assert copied != base  # another checkout, even with the same files and times
    source = sources / "cli" / "warm.py"
    st = source.stat()
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # kvsnap's code changed
    assert warm.key() != copied


def test_only_run_is_handed_over():
    assert warm.wanted(["run", "--prompt", "x"]) and warm.wanted(["--debug", "run"])
    assert not warm.wanted(["chat"]) and not warm.wanted(["warm", "start"]) and not warm.wanted([])
    assert not warm.wanted(["inspect", "run"])


def test_the_entry_point_hands_over_before_importing_the_app():
    # What a handed-over run costs its own process: the interpreter and a few stdlib modules.
    code = "import sys, cli.main, cli.warm; print(sorted({'typer', 'rich', 'click', 'cli.app'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_a_run_whose_kvsnap_gives_up_before_its_go_never_runs(warm_up, primed, env, tmp_path):
    # A `kvsnap run` that timed out waiting for the warm process runs the command itself: the child
    # the warm process forked for it must not run it a second time.
    model, _ = primed
    key = _key(env)
    target = tmp_path / "twice.kv"
    argv = ["kvsnap", "run", "--model", model, "--prompt", "hi", "--max-new-tokens", "1", "--save", str(target)]
    request = {"op": "run", "key": key, "argv": argv, "path0": "", "env": env, "umask": 0o22, "ignored": [], "mask": []}
    before = served(env)
    sock = warm.connect(Path(env["XDG_RUNTIME_DIR"]) / "kvsnap-warm" / f"{key}.sock")
    cwd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    with open(os.devnull, "rb") as null_in, open(os.devnull, "wb") as null_out:
        warm.send_frame(sock, request, [null_in.fileno(), null_out.fileno(), null_out.fileno(), cwd])
        reply, fds = warm.recv_frame(sock, max_fds=1)
        assert isinstance(reply["pid"], int) and len(fds) == 1  # forked, waiting for the go
    os.close(cwd)
    os.close(fds[0])
    sock.close()  # gave up
    deadline = time.monotonic() + 30
    while _running(env) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _running(env) == 0 and served(env) == before
    assert not target.exists()
