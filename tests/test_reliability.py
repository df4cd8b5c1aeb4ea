"""Nothing is lost on a crash, no damaged or foreign snapshot is ever used, and nothing unpickles.

Fault injection stops a save at every step (partial write, ENOSPC, fsync, rename, Ctrl-C): the
previous snapshot must still load bit-identically and no temp file may be left for good. Real
processes are killed with SIGKILL in the middle of their save, and two writers race on one path.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import kvsnap
from core_helpers import read_everything, write_test_snapshot
from typer.testing import CliRunner

from kvsnap.config import SamplingParams
from kvsnap.engine.session import Session
from kvsnap.errors import SnapshotError
from kvsnap.format import Snapshot
from kvsnap_cli.main import app

ROOT = Path(__file__).resolve().parents[1]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


class FailingFile:
    """A file object that writes ``limit`` bytes in all, then fails like a full disk."""

    def __init__(self, inner, limit: int, exc: BaseException):
        self.inner, self.left, self.exc = inner, limit, exc

    def write(self, data):
        data = memoryview(data).cast("B")
        if len(data) > self.left:
            self.inner.write(data[: self.left])
            self.left = 0
            raise self.exc
        self.left -= len(data)
        return self.inner.write(data)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.inner.close()


@pytest.fixture
def previous(tmp_path):
    """An existing snapshot, the one every failed save must leave intact."""
    written = write_test_snapshot(
        tmp_path / "s.kv", num_tokens=40, block_size=8, messages=[{"role": "user", "content": "x"}]
    )
    return written.path, sha(written.path), read_everything(written.path)


def assert_intact(path: Path, digest: str, content) -> None:
    assert sha(path) == digest
    assert read_everything(path) == content


@pytest.mark.parametrize(
    "step",
    ["partial-write-enospc", "partial-write-interrupt", "fsync", "rename", "rename-interrupt", "dir-fsync"],
)
def test_a_save_that_fails_at_any_step_leaves_the_previous_snapshot(previous, monkeypatch, step):
    path, digest, content = previous
    real_fdopen, real_fsync, real_replace = os.fdopen, os.fsync, os.replace
    if step.startswith("partial-write"):
        exc = OSError(errno.ENOSPC, "No space left on device") if "enospc" in step else KeyboardInterrupt()
        monkeypatch.setattr(os, "fdopen", lambda fd, mode: FailingFile(real_fdopen(fd, mode), 300, exc))
    elif step == "fsync":

        def bad_fsync(fd):
            raise OSError(errno.EIO, "I/O error")

        monkeypatch.setattr(os, "fsync", bad_fsync)
    elif step.startswith("rename"):

        def bad_replace(src, dst):
            raise KeyboardInterrupt() if "interrupt" in step else OSError(errno.EXDEV, "rename failed")

        monkeypatch.setattr(os, "replace", bad_replace)
    elif step == "dir-fsync":
        # The rename happened; only the folder fsync fails: the new file is complete, and that is fine.
        calls = []

        def fsync_dir_fails(fd):
            calls.append(fd)
            if len(calls) > 1:
                raise OSError(errno.EIO, "I/O error")
            return real_fsync(fd)

        monkeypatch.setattr(os, "fsync", fsync_dir_fails)

    with pytest.raises((OSError, KeyboardInterrupt)) if step != "dir-fsync" else _nothing():
        write_test_snapshot(path, num_tokens=64, block_size=8, seed=7)
    monkeypatch.setattr(os, "fdopen", real_fdopen)
    monkeypatch.setattr(os, "fsync", real_fsync)
    monkeypatch.setattr(os, "replace", real_replace)
    assert temps(path.parent) == []
    if step == "dir-fsync":
        assert read_everything(path)["tokens"] != content["tokens"]  # the new, complete file
    else:
        assert_intact(path, digest, content)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_next_save_removes_what_a_crash_left(previous):
    path, _, _ = previous
    # What a SIGKILL in mid-save leaves behind: a half-written temp file beside the snapshot.
    stale = path.parent / f".{path.name}.abcd1234.tmp"
    stale.write_bytes(b"half a snapshot")
    other = path.parent / f".{path.name}.x.kv.abcd1234.tmp"  # another file's temp: not ours to remove
    other.write_bytes(b"")
    write_test_snapshot(path, num_tokens=12, block_size=8, seed=3)
    assert not stale.exists() and other.exists()
    assert read_everything(path)["tokens"]


def test_session_save_failure_keeps_previous_file_and_session(llama, tmp_path, monkeypatch):
    session = Session(llama, block_size=8)
    session.prefill(list(range(1, 30)))
    path = tmp_path / "s.kv"
    session.save(path)
    digest = sha(path)
    session.prefill(list(range(1, 50)))
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    with pytest.raises(OSError):
        session.save(path)
    monkeypatch.setattr(os, "replace", real_replace)
    assert sha(path) == digest and temps(tmp_path) == []
    assert session.save(path).tokens == 49  # the session itself is unharmed


_WRITER = """
import sys
sys.path.insert(0, {tests!r}); sys.path.insert(0, {root!r})
from pathlib import Path
from core_helpers import write_test_snapshot, make_layout
layout = make_layout("float32", layers=8, kv_heads=4, head_dim=32)
for i in range({rounds}):
    write_test_snapshot(Path({path!r}), num_tokens=2048, block_size=64, layout=layout, seed={seed})
"""


def test_two_writers_on_one_path_and_a_reader_never_sees_half_a_file(tmp_path):
    path = tmp_path / "race.kv"
    expected = {}
    for seed in (1, 2):
        w = write_test_snapshot(tmp_path / f"ref{seed}.kv", num_tokens=2048, block_size=64, seed=seed, layout=_big())
        expected[seed] = w.tokens
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _WRITER.format(tests=str(Path(__file__).parent), root=str(ROOT), rounds=6, path=str(path), seed=seed),
            ]
        )
        for seed in (1, 2)
    ]
    reads = 0
    while any(p.poll() is None for p in procs):
        if path.exists():
            with Snapshot(path) as s:  # a half-written file would raise here
                assert s.tokens in (expected[1], expected[2])
                assert not s.verify()
            reads += 1
    assert all(p.wait() == 0 for p in procs)
    with Snapshot(path) as s:
        assert s.tokens in (expected[1], expected[2]) and not s.verify()
    assert temps(tmp_path) == []
    assert reads > 0


def _big():
    from core_helpers import make_layout

    return make_layout("float32", layers=8, kv_heads=4, head_dim=32)


def test_refused_snapshot_can_fall_back_to_recompute(llama, tmp_path):
    session = Session(llama, block_size=8)
    prompt = list(range(1, 40))
    bad = tmp_path / "bad.kv"
    bad.write_bytes(b"not a snapshot at all, just some bytes")
    greedy = SamplingParams(max_new_tokens=4, temperature=0)
    with pytest.raises(SnapshotError):
        session.run(prompt, greedy, resume=bad)
    result = Session(llama, block_size=8, on_mismatch="recompute").run(prompt, greedy, resume=bad)
    cold = Session(llama, block_size=8).run(prompt, greedy)
    assert result.restore_error and "bad.kv" in result.restore_error
    assert result.hit_tokens == 0 and result.prefill_tokens == len(prompt)
    assert result.text == cold.text


def test_cli_on_mismatch(tiny_model_dir, tmp_path):
    model = str(tiny_model_dir("llama"))
    bad = tmp_path / "bad.kv"
    bad.write_bytes(os.urandom(200))
    runner = CliRunner()
    base = ["run", "--model", model, "--device", "cpu", "--prompt", "hello", "--resume", str(bad), "--json"]
    assert runner.invoke(app, base).exit_code == 1
    ok = runner.invoke(app, [*base, "--on-mismatch", "recompute", "--max-new-tokens", "2"])
    assert ok.exit_code == 0, ok.output
    row = json.loads(ok.stdout)
    assert row["restore_error"] and row["hit_tokens"] == 0
    assert "recomputed from scratch" in ok.stderr

    chat = ["chat", "--model", model, "--device", "cpu", "--resume", str(bad)]
    refused = kvsnap(*chat, input="hi\n")
    assert refused.returncode == 1 and "bad.kv" in refused.stderr  # not a terminal: "ask" means error
    before = bad.read_bytes()
    go_on = kvsnap(*chat, "--on-mismatch", "recompute", "--max-new-tokens", "2", input="hi\n")
    assert go_on.returncode == 0, go_on.stderr
    assert "starting a new conversation" in go_on.stderr
    # The damaged file is the user's to look at: the new conversation is saved beside it, not over it.
    assert before == bad.read_bytes()
    with Snapshot(tmp_path / "bad-2.kv") as s:
        assert s.meta.messages and s.meta.messages[0]["content"] == "hi"


def test_no_pickle_in_the_load_path(llama, tmp_path, monkeypatch):
    import pickle

    session = Session(llama, block_size=8)
    session.prefill(list(range(1, 30)))
    path = tmp_path / "s.kv"
    session.save(path)

    def forbidden(*args, **kwargs):
        raise AssertionError("pickle used while loading a snapshot")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden)
    import torch

    monkeypatch.setattr(torch, "load", forbidden)
    restored = Session(llama, block_size=8)
    restored.restore(path, list(range(1, 35)))
    assert restored.tokens == list(range(1, 30))
    assert CliRunner().invoke(app, ["inspect", str(path), "--json", "--verify"]).exit_code == 0


# ---------------------------------------------------------------------------------------------
# SIGKILL during a real `kvsnap run --save`

# `kvsnap run` that kills itself with SIGKILL at one chosen point of its save of the file named
# $KILL_TARGET: no timing involved, every point is hit on every run.
_KILLED_SAVE = """
import os, signal, sys
sys.path.insert(0, {root!r})
from kvsnap.format import atomic

point, target = os.environ["KILL_AT"], os.environ["KILL_TARGET"]
real_replace_whole, real_fdopen, real_fsync, real_replace = atomic.replace_whole, os.fdopen, os.fsync, os.replace
ours = {{}}  # the save of the target now under way: its size, and the fd of its temp file


def die():
    os.kill(os.getpid(), signal.SIGKILL)


class Dying:  # the temp file; the process dies once half the file is written
    def __init__(self, inner):
        self.inner, self.left = inner, ours["size"] // 2

    def write(self, data):
        data = memoryview(data).cast("B")
        if point == "mid-write" and len(data) >= self.left:
            self.inner.write(data[: self.left])
            self.inner.flush()  # in the kernel's page cache: what a kill leaves on disk
            die()
        self.left -= len(data)
        return self.inner.write(data)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.inner.close()


def replace_whole(path, parts, mode=None):
    if os.path.basename(path) == target:
        ours["size"] = sum(memoryview(p).nbytes for p in parts)
    return real_replace_whole(path, parts, mode)


def fdopen(fd, *args, **kwargs):
    f = real_fdopen(fd, *args, **kwargs)
    if "size" in ours and "fd" not in ours:  # the temp file replace_whole just made
        ours["fd"] = fd
        if point == "temp-created":
            die()
        return Dying(f)
    return f


def fsync(fd):
    if fd == ours.get("fd") and point == "written":  # every byte written and flushed, not yet fsynced
        die()
    return real_fsync(fd)


def replace(src, dst):
    if os.path.basename(dst) == target and point == "before-rename":
        die()
    real_replace(src, dst)
    if os.path.basename(dst) == target and point == "after-rename":  # before the folder's fsync
        die()


atomic.replace_whole, os.fdopen, os.fsync, os.replace = replace_whole, fdopen, fsync, replace
from kvsnap_cli.main import main
sys.argv = ["kvsnap", "run", *sys.argv[1:]]
main()
"""

# Where the save dies, and which file the target must then be: the old one until the rename, the new one after.
KILL_POINTS = [
    ("temp-created", "old"),
    ("mid-write", "old"),
    ("written", "old"),
    ("before-rename", "old"),
    ("after-rename", "new"),
]


@pytest.fixture(scope="module")
def kill_scene(tiny_model_dir, tmp_path_factory):
    """A document snapshot to resume (new) and an older, shorter one (old), written by `kvsnap run`."""
    folder = tmp_path_factory.mktemp("killed-save")
    model = str(tiny_model_dir("llama"))
    # --reuse load: a resume under auto would first measure this machine (seconds, in each process).
    base = [
        "run",
        "--model",
        model,
        "--device",
        "cpu",
        "--block-size",
        "16",
        "--max-new-tokens",
        "0",
        "--reuse",
        "load",
    ]
    doc = folder / "doc.txt"
    doc.write_text("the quick brown fox jumps over the lazy dog 0123456789 " * 40)  # ~50 blocks
    primed, old = folder / "primed.kv", folder / "old.kv"
    for args in (
        ["--prompt-file", str(doc), "--save", str(primed)],
        ["--prompt", "an older session", "--save", str(old)],
    ):
        ran = kvsnap(*base, *args)
        assert ran.returncode == 0, ran.stderr
    return base, doc, primed, old


@pytest.mark.parametrize(("point", "left"), KILL_POINTS, ids=[p for p, _ in KILL_POINTS])
def test_sigkill_during_save_never_leaves_a_broken_snapshot(kill_scene, tmp_path, kvsnap_home, point, left):
    base, doc, primed, old = kill_scene
    target = tmp_path / "out.kv"
    shutil.copyfile(old, target)
    with Snapshot(primed) as s:
        new_tokens = s.tokens
    with Snapshot(old) as s:
        old_tokens = s.tokens
    env = {**os.environ, "KVSNAP_HOME": str(kvsnap_home), "KILL_AT": point, "KILL_TARGET": target.name}
    # --codec zstd: the primed file's blocks are encoded again, so the whole file is written anew.
    args = [*base[1:], "--prompt-file", str(doc), "--resume", str(primed), "--save", str(target), "--codec", "zstd"]
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_SAVE.format(root=str(ROOT)), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]  # killed where asked, not finished
    with Snapshot(target) as s:  # whole: either the old file or the new one, never half
        assert s.tokens == (old_tokens if left == "old" else new_tokens)
        assert not s.verify()
    assert bool(temps(tmp_path)) == (left == "old")  # before the rename, the temp file is what the kill left
    again = kvsnap(*base, "--prompt", "x", "--save", str(target))
    assert again.returncode == 0, again.stderr
    assert temps(tmp_path) == []  # the next save swept up what the kill left


# ---------------------------------------------------------------------------------------------
# Foreign snapshots say what differs


def _variant(src: Path, dst: Path, kind: str) -> Path:
    from tiny_models import perturbed_copy

    if kind == "weights":
        return perturbed_copy(src, dst)
    shutil.copytree(src, dst)
    if kind == "tokenizer":
        cfg = json.loads((dst / "tokenizer_config.json").read_text())
        cfg["model_max_length"] = 1234  # any change to the tokenizer files is another tokenizer
        (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    elif kind == "config":
        cfg = json.loads((dst / "config.json").read_text())
        cfg.setdefault("rope_parameters", {})["rope_theta"] = 1234.0
        cfg.pop("rope_theta", None)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("kind", ["weights", "tokenizer", "config"])
def test_foreign_snapshot_refusal_names_what_differs(tiny_model_dir, llama, tmp_path, kind):
    from kvsnap.errors import ForeignSnapshotError
    from kvsnap.models import load_model

    session = Session(llama, block_size=8)
    session.prefill(list(range(1, 30)))
    path = tmp_path / "a.kv"
    session.save(path)
    other = load_model(str(_variant(tiny_model_dir("llama"), tmp_path / kind, kind)), device="cpu")
    assert other.fingerprint != llama.fingerprint
    with pytest.raises(ForeignSnapshotError, match=f"different {kind}"):
        Session(other, block_size=8).restore(path, list(range(1, 30)))


def test_snapshot_in_another_dtype_or_version_is_refused_with_the_reason(tiny_lm, llama, tmp_path):
    from kvsnap.errors import ForeignSnapshotError

    session = Session(llama, block_size=8)
    session.prefill(list(range(1, 30)))
    path = tmp_path / "a.kv"
    session.save(path)
    with pytest.raises(ForeignSnapshotError, match="float32.*bfloat16"):
        Session(tiny_lm("llama", "bfloat16"), block_size=8).restore(path)


def test_snapshot_with_another_block_size_is_read_with_its_own(llama, tmp_path):
    """Not a refusal: the file's block size keys its own chain, so the session matches with it."""
    prompt = list(range(1, 40))
    writer = Session(llama, block_size=8)
    writer.prefill(prompt[:30])
    path = tmp_path / "a.kv"
    writer.save(path)
    reader = Session(llama, block_size=16)
    stats = reader.restore(path, prompt)
    assert stats.hit_tokens == 30 and reader.tokens == prompt[:30]
    assert reader.save(tmp_path / "b.kv").blocks_encoded == 2  # re-keyed in its own block size


def test_saving_after_the_resumed_file_was_truncated_in_place_does_not_crash(llama, tmp_path):
    """Guards a SIGBUS: a session keeps views of the mapped file it resumed; `cp other.kv it.kv`
    truncates that file in place, and touching a view past its new end killed the process."""
    src = tmp_path / "a.kv"
    writer = Session(llama, block_size=8)
    writer.prefill(list(range(1, 100)))
    writer.save(src)
    session = Session(llama, block_size=8)
    session.restore(src)
    with open(src, "r+b") as f:
        f.truncate(100)
    stats = session.save(tmp_path / "b.kv")
    assert stats.blocks_encoded == stats.blocks  # nothing taken from the damaged file
    assert read_everything(tmp_path / "b.kv")["tokens"] == list(range(1, 100))


def test_a_save_into_a_missing_folder_is_a_one_line_kvsnap_error(llama, tmp_path):
    from kvsnap.errors import KvsnapError, SaveError

    session = Session(llama, block_size=8)
    session.prefill(list(range(1, 20)))
    with pytest.raises(SaveError) as info:
        session.save(tmp_path / "missing" / "a.kv")
    assert isinstance(info.value, KvsnapError) and isinstance(info.value, OSError)
    assert "\n" not in str(info.value) and "missing" in str(info.value)
