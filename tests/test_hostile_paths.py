"""Hostile paths and inputs (issue 13): FIFOs, devices, symlinks, bombs, bad text, stale digests.

Every case here once hung, ate gigabytes, wrote through a link, reused a stale KV or printed raw
terminal escapes. Commands that could hang on a regression run in a thread given a deadline
(``within``); those where memory is the risk run in a subprocess with a timeout and an
address-space limit. Either way a regression fails, it does not hang or eat the machine.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import zstandard
from core_helpers import MODEL, kvsnap_imports, make_layout, rewrite_meta, write_test_snapshot
from typer.testing import CliRunner

from kvsnap import hashing
from kvsnap.errors import SaveError, SnapshotError
from kvsnap.format import Snapshot, SnapshotHeader, atomic, codec, write_snapshot
from kvsnap.hashing import checksum
from kvsnap.models.fingerprint import weights_digest
from kvsnap.types import EncodedBlock
from kvsnap_cli.main import app

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def invoke(*args: str | Path, input: str | bytes | None = None):
    return runner.invoke(app, [str(a) for a in args], input=input)


def base(model: str | Path) -> list[str]:
    return ["--model", str(model), "--device", "cpu", "--block-size", "16", "--chunk-size", "32"]


def kvsnap(*args: str | Path, home: Path, timeout: float = 120, memory: int | None = None, input: bytes = b""):
    """``kvsnap ARGS`` in a subprocess: a hang becomes a timeout, ``memory`` caps its address space."""
    code = "import sys; from kvsnap_cli.main import main; sys.argv[0] = 'kvsnap'; main()"
    if memory is not None:
        code = f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({memory}, {memory})); {code}"
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        input=input,
        capture_output=True,
        cwd=ROOT,
        env={**os.environ, "KVSNAP_HOME": str(home)},
        timeout=timeout,
    )


def within(seconds: float, fn: Callable[[], object], fifo: Path | None = None) -> object:
    """``fn()`` in a thread; fails if it has not returned after ``seconds`` (then a writer opened on
    ``fifo`` lets a read blocked on it finish, so the thread does not outlive the test)."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the test thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if fifo is not None:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"still running after {seconds} s (hung)")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("value")


def lines_of(stdout: str | bytes) -> list[dict]:
    text = stdout.decode() if isinstance(stdout, bytes) else stdout

    def strict(name: str) -> None:
        raise AssertionError(f"not strict JSON: {name}")

    return [json.loads(line, parse_constant=strict) for line in text.splitlines() if line.strip()]


@pytest.fixture
def model(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture
def fifo(tmp_path) -> Path:
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


# -- 2. a digest fooled by a restored mtime -----------------------------------------------------------


def rewrite_weights_in_place(folder: Path) -> None:
    """Change a few weights without changing the file's size, then set its mtime back."""
    weights = folder / "model.safetensors"
    before = weights.stat()
    # A later rewrite, as a user's would be: once the file system's clock (coarse: one tick is a few
    # ms) has moved past the file's ctime, so the write gets a new one. Waited for, not slept on.
    probe = folder / "clock-probe"
    probe.touch()
    while probe.stat().st_ctime_ns <= before.st_ctime_ns:
        os.utime(probe)  # sets the probe's ctime to the clock's now
    probe.unlink()
    with open(weights, "r+b") as f:
        f.seek(-16, os.SEEK_END)
        tail = bytearray(f.read(16))
        f.seek(-16, os.SEEK_END)
        f.write(bytes(b ^ 0x01 for b in tail))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = weights.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert after.st_ctime_ns != before.st_ctime_ns  # what still tells the rewrite apart


def test_weights_digest_sees_an_in_place_rewrite_with_the_mtime_set_back(model, tmp_path):
    """Bug: the weights digest was cached by size and mtime, so weights rewritten in place with the
    mtime restored kept the old digest."""
    folder = tmp_path / "model"
    shutil.copytree(model, folder)
    old = weights_digest(folder)
    assert weights_digest(folder) == old  # cached
    rewrite_weights_in_place(folder)
    assert weights_digest(folder) != old


def test_resume_against_weights_changed_in_place_is_refused(model, tmp_path):
    """Bug: after the weights were changed in place (same size, mtime restored) `run --resume` reused
    the old snapshot's KV and printed different text with exit 0."""
    folder = tmp_path / "model"
    shutil.copytree(model, folder)
    snap = tmp_path / "s.kv"
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    first = invoke("run", *base(folder), "--prompt", prompt, "--max-new-tokens", "0", "--save", snap)
    assert first.exit_code == 0, first.output
    rewrite_weights_in_place(folder)
    resumed = invoke("run", *base(folder), "--prompt", prompt, "--max-new-tokens", "2", "--resume", snap, "--json")
    assert resumed.exit_code == 1, resumed.output
    assert "another model" in resumed.stderr and "weights" in resumed.stderr


# -- 3. save targets: symlinks, special files, odd folders, a held lock ------------------------------


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_save_onto_a_link_or_special_file_is_refused_before_the_model_loads(model, tmp_path, kind):
    """Bug: `--save` onto a symlink wrote through it (overwriting the link's target) and a FIFO as the
    target was replaced by a regular file, after the whole run."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    target = tmp_path / "out.kv"
    if kind == "symlink":
        target.symlink_to(victim)
    elif kind == "fifo":
        os.mkfifo(target)
    else:
        target.mkdir()
    result = invoke("run", *base(model), "--prompt", "hello", "--max-new-tokens", "1", "--save", target)
    assert result.exit_code == 1, result.output
    assert "loading" not in result.stderr and "Traceback" not in result.output
    assert {"symlink": "symbolic link", "fifo": "a FIFO", "directory": "a directory"}[kind] in result.stderr
    assert victim.read_text() == "keep me"
    mode = os.lstat(target).st_mode
    assert {"symlink": stat.S_ISLNK, "fifo": stat.S_ISFIFO, "directory": stat.S_ISDIR}[kind](mode)


def test_save_onto_a_file_that_is_not_a_snapshot_is_refused_and_the_file_kept(model, tmp_path):
    """Bug: `--save` onto someone's notes (or any file that is not a snapshot) replaced it silently."""
    notes = tmp_path / "notes.txt"
    notes.write_text("someone's notes")
    result = invoke("run", *base(model), "--prompt", "hello", "--max-new-tokens", "1", "--save", notes)
    assert result.exit_code == 1 and "loading" not in result.stderr and "Traceback" not in result.output
    assert "is not a kvsnap snapshot" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert notes.read_text() == "someone's notes"
    with pytest.raises(SaveError, match="is not a kvsnap snapshot"):
        write_test_snapshot(notes)  # the library's saves refuse it too
    assert notes.read_text() == "someone's notes"
    write_test_snapshot(tmp_path / "s.kv")
    write_test_snapshot(tmp_path / "s.kv", seed=1)  # a snapshot is replaced as before


def test_save_into_a_folder_no_file_can_be_made_in_is_refused_before_the_model_loads(tmp_path):
    """Bug: `--save` into a folder that cannot be written failed only once the model had run. /proc
    refuses new files even to root, whom permissions do not stop."""
    missing_model = tmp_path / "no-model-here"
    result = invoke("run", "--model", missing_model, "--prompt", "hi", "--save", "/proc/kvsnap-test.kv")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "cannot create a file in /proc" in result.stderr and str(missing_model) not in result.stderr


def test_an_error_about_a_foreign_file_never_shows_its_bytes(tmp_path):
    """Bug: the error about a file that is not a snapshot echoed its first 16 bytes ('root:x:0:0:root:')."""
    foreign = tmp_path / "passwd.kv"
    foreign.write_text("root:x:0:0:root:/root:/bin/bash\n")
    result = invoke("inspect", foreign)
    assert result.exit_code == 1 and "not a kvsnap snapshot" in result.stderr
    assert "root:x" not in result.output


def test_write_snapshot_never_writes_through_a_link_nor_replaces_a_fifo(tmp_path):
    """Bug: `atomic_write` followed symlinks (realpath), so `store export` onto a link overwrote its
    target; a FIFO at the target was replaced by a regular file."""
    victim = tmp_path / "victim.kv"
    write_test_snapshot(victim)
    before = victim.read_bytes()
    link = tmp_path / "link.kv"
    link.symlink_to(victim)
    with pytest.raises(SaveError, match="symbolic link"):
        write_test_snapshot(link, seed=1)
    assert victim.read_bytes() == before and link.is_symlink()
    pipe = tmp_path / "pipe.kv"
    os.mkfifo(pipe)
    with pytest.raises(SaveError, match="FIFO"):
        write_test_snapshot(pipe)
    assert stat.S_ISFIFO(os.lstat(pipe).st_mode)


def test_save_into_a_missing_folder_creates_nothing(tmp_path):
    """Bug: the folder lock of a save into a missing folder created a file named as the folder."""
    with pytest.raises(SaveError, match="does not exist"):
        write_test_snapshot(tmp_path / "missing" / "s.kv")
    assert not (tmp_path / "missing").exists()


def test_save_does_not_hang_on_a_folder_lock_held_elsewhere(tmp_path, monkeypatch):
    """Bug: a save waited forever for the folder lock, so anyone holding a lock on a shared folder
    (or a hung writer) hung every save into it."""
    monkeypatch.setattr(atomic, "LOCK_WAIT_S", 0.3)
    holder = os.open(tmp_path, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        within(30, lambda: write_test_snapshot(tmp_path / "s.kv"))
    finally:
        os.close(holder)
    with Snapshot(tmp_path / "s.kv") as snap:
        assert not snap.verify()


# -- 4. snapshots are private -------------------------------------------------------------------------


def test_snapshots_are_created_0600_and_never_widened(tmp_path):
    """Bug: with umask 022 a .kv was 0644, the conversation readable by every user of the machine."""
    old_umask = os.umask(0o022)
    try:
        path = tmp_path / "s.kv"
        write_test_snapshot(path)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        for existing, expected in ((0o644, 0o600), (0o640, 0o600), (0o400, 0o400)):
            os.chmod(path, existing)
            write_test_snapshot(path, seed=2)
            assert stat.S_IMODE(os.stat(path).st_mode) == expected, oct(existing)
    finally:
        os.umask(old_umask)


# -- 5. FIFOs where a file is read ----------------------------------------------------------------------


def test_a_fifo_as_a_snapshot_is_refused_not_waited_on(fifo):
    """Bug: opening a FIFO as a snapshot (`--resume`, `inspect`, `store import`) hung forever."""
    with pytest.raises(SnapshotError, match="FIFO"):
        within(30, lambda: Snapshot(fifo), fifo=fifo)


def test_cli_refuses_a_fifo_for_inspect_store_import_and_prompt_files(model, tmp_path, fifo):
    """Bug: `kvsnap inspect FIFO`, `store import DIR FIFO` and `inspect --prompt-file FIFO` hung forever."""
    snap = tmp_path / "s.kv"
    write_test_snapshot(snap, extra={"model_folder": str(model)})
    for args in (
        ["inspect", fifo],
        ["store", "import", tmp_path / "store", fifo],
        ["inspect", snap, "--prompt-file", fifo],
    ):
        result = within(60, lambda args=args: invoke(*args), fifo=fifo)
        assert result.exit_code == 1, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
        assert "FIFO" in result.stderr


def test_run_refuses_a_fifo_as_resume(model, fifo):
    """Bug: `run --resume FIFO` hung forever after loading the model."""
    result = within(60, lambda: invoke("run", *base(model), "--prompt", "hi", "--resume", fifo), fifo=fifo)
    assert result.exit_code == 1, result.output
    assert "FIFO" in result.stderr


# -- 6. devices as prompt files: bounded reads ----------------------------------------------------------


def test_batch_prompt_files_that_are_not_regular_files_are_error_rows(model, tmp_path, fifo, kvsnap_home):
    """Bug: a batch `prompt_file` of /dev/zero or /dev/urandom was read until MemoryError (its size is 0
    to stat) and the rest of the batch was lost; a FIFO hung the batch."""
    jobs = [
        {"id": "fifo", "prompt_file": str(fifo)},
        {"id": "zero", "prompt_file": "/dev/zero"},
        {"id": "urandom", "prompt_file": "/dev/urandom"},
        {"id": "folder", "prompt_file": str(tmp_path)},
        {"id": "ok", "prompt": "hello", "max_new_tokens": 1},
    ]
    batch = tmp_path / "jobs.jsonl"
    batch.write_text("".join(json.dumps(j) + "\n" for j in jobs))
    result = kvsnap("run", *base(model), "--batch", batch, home=kvsnap_home, timeout=180, memory=3 << 30)
    assert result.returncode == 1, result.stderr
    rows = {row["id"]: row for row in lines_of(result.stdout)}
    assert list(rows) == ["fifo", "zero", "urandom", "folder", "ok"]
    assert "a FIFO" in rows["fifo"]["error"]
    assert "character device" in rows["zero"]["error"] and "character device" in rows["urandom"]["error"]
    assert "a directory" in rows["folder"]["error"]
    assert "error" not in rows["ok"] and rows["ok"]["new_tokens"] == 1


def test_inspect_prompt_file_from_a_device_is_refused_with_bounded_memory(model, tmp_path, kvsnap_home):
    """Bug: `inspect --prompt-file /dev/zero` read until MemoryError: the size cap checked st_size only."""
    snap = tmp_path / "s.kv"
    write_test_snapshot(snap, extra={"model_folder": str(model)})
    result = kvsnap("inspect", snap, "--prompt-file", "/dev/zero", home=kvsnap_home, timeout=60, memory=1 << 30)
    assert result.returncode == 1 and b"character device" in result.stderr, result.stderr
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate((64 << 20) + 1)
    result = kvsnap("inspect", snap, "--prompt-file", big, home=kvsnap_home, timeout=60, memory=1 << 30)
    assert result.returncode == 1 and b"larger than 64 MiB" in result.stderr, result.stderr


def test_batch_file_that_is_a_device_is_refused(model, kvsnap_home):
    """Bug: `run --batch /dev/zero` read one endless line until memory ran out."""
    result = kvsnap("run", *base(model), "--batch", "/dev/zero", home=kvsnap_home, timeout=60, memory=3 << 30)
    assert result.returncode == 1 and b"character device" in result.stderr, result.stderr


# -- 8. a zstd bomb under inspect --verify --------------------------------------------------------------


def write_bomb(path: Path) -> int:
    """A valid snapshot of one block that declares 256 MiB of raw KV in about 8 KB of shuffle-zstd."""
    layout = make_layout("float32", layers=64, kv_heads=64, head_dim=128)  # 4 MiB of KV per token
    tokens = list(range(64))
    raw_bytes = len(tokens) * layout.bytes_per_token
    plane = raw_bytes // 4
    compressor = zstandard.ZstdCompressor(level=3, write_content_size=True).compressobj(size=plane)
    frame = b"".join(compressor.compress(bytes(1 << 20)) for _ in range(plane >> 20)) + compressor.flush()
    stored = bytes([4]) + b"".join(bytes([1]) + len(frame).to_bytes(8, "little") for _ in range(4)) + frame * 4
    root = hashing.chain_root("fp", "", 64)
    block = EncodedBlock(64, hashing.chain_hashes(tokens, 64, root)[0], raw_bytes, stored, checksum(stored))
    header = SnapshotHeader(
        model=MODEL, fingerprint="fp", root=root, layout=layout, block_size=64, codec="shuffle-zstd"
    )
    write_snapshot(path, header, tokens, [block])
    return raw_bytes


def test_verify_of_a_zstd_bomb_keeps_memory_bounded(tmp_path, kvsnap_home):
    """Bug: a small zstd bomb .kv made `inspect --verify` use over a gigabyte: verify decoded every
    block whole into fresh buffers."""
    bomb = tmp_path / "bomb.kv"
    raw_bytes = write_bomb(bomb)
    assert bomb.stat().st_size < 64 << 10 and raw_bytes == 256 << 20
    code = (
        "import json, resource, sys\n"
        "from kvsnap.format import Snapshot\n"
        "peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\n"
        "with Snapshot(sys.argv[1]) as snap:\n"
        "    before = peak()\n"
        "    problems = snap.verify()\n"
        "    print(json.dumps({'problems': problems, 'grew': peak() - before}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(bomb)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["problems"] == []  # a bomb of zeros is a sound block: it is the memory that matters
    assert report["grew"] < 32 << 20, f"verify grew the peak RSS by {report['grew'] >> 20} MiB"
    result = kvsnap("inspect", "--verify", bomb, home=kvsnap_home, timeout=120, memory=1 << 30)
    assert result.returncode == 0 and b"all blocks verified" in result.stdout, result.stderr


def test_verify_still_refuses_what_decoding_refuses():
    """Streaming verify (the bomb fix) must refuse exactly what decoding refuses: bytes after a zstd
    frame, a second frame, a cut frame, a skippable frame after it."""
    frame = codec.encode(bytes(64), 4, "zstd")
    skippable = (0x184D2A50).to_bytes(4, "little") + (4).to_bytes(4, "little") + b"abcd"
    codec.check(frame, 64, 4, "zstd")
    for bad in (frame + b"\x00\x01", frame + frame, frame[:-2], frame + skippable):
        with pytest.raises(codec.CodecError):
            codec.check(bad, 64, 4, "zstd")
        with pytest.raises(codec.CodecError):
            codec.decode(bad, 64, 4, "zstd")


# -- 10. text that is not UTF-8; 11-ish output hygiene: strict JSON -------------------------------------


def test_batch_bad_text_lines_are_error_rows_and_the_batch_goes_on(model):
    """Bug: a batch line with a non-UTF-8 byte aborted the batch with UnicodeDecodeError (rows before it
    lost); a prompt with a lone surrogate failed in the tokenizer with a TypeError; ids 1e400 and NaN
    came out as Infinity and NaN, which is not JSON."""
    lines = [
        b'{"id": "first", "prompt": "hello", "max_new_tokens": 1}',
        b'{"id": "latin1", "prompt": "caf\xe9"}',
        b'{"id": "surrogate", "prompt": "\\ud800 hi"}',
        b'{"id": 1e400, "prompt": "hi", "max_new_tokens": 1}',
        b'{"id": NaN, "prompt": "hi", "max_new_tokens": 1}',
        b'{"id": "last", "prompt": "hello", "max_new_tokens": 1, "temperature": Infinity}',
        b'{"id": "end", "prompt": "hello", "max_new_tokens": 1}',
    ]
    result = invoke("run", *base(model), "--batch", "-", input=b"\n".join(lines) + b"\n")
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    rows = lines_of(result.stdout)
    assert [r["id"] for r in rows] == ["first", 2, "surrogate", "1e400", "NaN", "last", "end"]
    assert "line 2: not valid UTF-8" in rows[1]["error"]
    assert '"prompt" is not valid UTF-8 text' in rows[2]["error"]
    assert "error" not in rows[3] and "error" not in rows[4]
    assert "finite" in rows[5]["error"]
    assert "error" not in rows[0] and "error" not in rows[6]


@pytest.mark.parametrize("flag", ["--prompt", "--system", "--namespace"])
def test_arguments_that_are_not_utf8_are_refused_before_the_model_loads(model, flag):
    """Bug: invalid UTF-8 bytes in `--prompt`/`--namespace` (kept by Python as surrogate escapes) gave a
    UnicodeEncodeError or tokenizer TypeError after the model loaded and generated."""
    args = ["--prompt", "hi", "--chat"] if flag == "--system" else ([] if flag == "--prompt" else ["--prompt", "hi"])
    result = invoke("run", *base(model), *args, flag, "caf\udce9")
    assert result.exit_code == 1, result.output
    assert f"{flag} is not valid UTF-8 text" in result.stderr and "loading" not in result.stderr


# -- 11. inspect never imports torch ------------------------------------------------------------------------


def model_without_tokenizer_json(model: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "no-tokenizer-json"
    folder.mkdir()
    for name in os.listdir(model):
        if name != "tokenizer.json":
            shutil.copy(model / name, folder / name)
    return folder


def test_inspect_without_tokenizer_json_does_not_import_torch(model, tmp_path, kvsnap_home):
    """Bug: `inspect` fell back to transformers (331 MB, torch imported) when the snapshot's model
    folder had config.json but no tokenizer.json."""
    snap = tmp_path / "s.kv"
    write_test_snapshot(snap, extra={"model_folder": str(model_without_tokenizer_json(model, tmp_path))})
    out, imported = kvsnap_imports("inspect", str(snap), env={**os.environ, "KVSNAP_HOME": str(kvsnap_home)}, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "torch" not in imported
    assert "tokenizer.json not found" in out.stdout and "no text preview" in out.stdout


def test_inspect_prompt_without_tokenizer_json_says_why(model, tmp_path):
    """Bug: without tokenizer.json, `inspect --prompt` loaded transformers' tokenizer (and torch)."""
    snap = tmp_path / "s.kv"
    write_test_snapshot(snap, extra={"model_folder": str(model_without_tokenizer_json(model, tmp_path))})
    result = invoke("inspect", snap, "--prompt", "hello")
    assert result.exit_code == 1
    assert "tokenizer.json not found" in result.stderr and "cannot be tokenized" in result.stderr


# -- terminal escapes in snapshot text ---------------------------------------------------------------------


def test_inspect_escapes_control_characters_and_markup_in_snapshot_text(tmp_path):
    """Bug: `inspect` printed a snapshot's messages raw: an ANSI title-setting sequence in a message
    changed the terminal's title (and rich markup in it was interpreted)."""
    snap = tmp_path / "s.kv"
    evil = "\x1b]0;pwned\x07 [bold red]loud[/] \x9b2J"
    write_test_snapshot(snap, messages=[{"role": "user", "content": evil}, {"role": "assistant", "content": "ok"}])
    rewrite_meta(snap, lambda meta: meta.update(model="evil\x1b[2Jmodel"))
    result = invoke("inspect", snap)
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.stdout and "\x07" not in result.stdout and "\x9b" not in result.stdout
    assert "\\x1b]0;pwned\\x07 [bold red]loud[/] \\x9b2J" in result.stdout
    assert "evil\\x1b[2Jmodel" in result.stdout


def test_notes_and_errors_escape_control_characters(capsys):
    """Bug: chat's "last answer" note (and errors quoting file names) printed snapshot text raw."""
    from kvsnap_cli import ui

    ui.note("last answer: \x1b]0;pwned\x07 [/] done")
    ui.error("bad \x1b[31m [bold]name[/]")
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err
    assert "\\x1b]0;pwned\\x07 [/] done" in err and "bad \\x1b[31m [bold]name[/]" in err


def test_json_output_stays_strict(capsysbinary):
    """Bug: a non-finite number in a row was written as NaN/Infinity, and a lone surrogate (a file name
    that is not UTF-8) failed the write."""
    from kvsnap_cli import ui

    ui.print_json({"id": float("inf"), "x": [float("nan")], "path": "caf\udce9.kv"})
    (row,) = lines_of(capsysbinary.readouterr().out)
    assert row == {"id": "inf", "x": ["nan"], "path": "caf\udce9.kv"}


# -- model folders: files transformers, tokenizers and safetensors read ---------------------------------


@pytest.mark.parametrize(
    "name", ["tokenizer.json", "model.safetensors", "chat_template.jinja", "special_tokens_map.json"]
)
@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_model_folder_holding_a_fifo_or_device_is_refused_naming_the_file(model, tmp_path, name, kind):
    """Before: a FIFO tokenizer.json or model.safetensors failed deep inside transformers with its own
    words ("Couldn't instantiate the backend tokenizer", "no file named model.safetensors"), and a FIFO
    chat template was silently taken for no template. Now the file is named before anything reads it."""
    from kvsnap.errors import ModelError
    from kvsnap.models.resolve import resolve_model

    folder = tmp_path / "model"
    shutil.copytree(model, folder)
    target = folder / name
    target.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(target)
    else:
        target.symlink_to("/dev/null")
    with pytest.raises(ModelError, match="FIFO" if kind == "fifo" else "character device") as err:
        within(30, lambda: resolve_model(str(folder)), fifo=target if kind == "fifo" else None)
    assert str(target) in str(err.value) and "not a regular file" in str(err.value)


def test_a_fifo_among_the_extra_chat_templates_is_refused(model, tmp_path):
    """transformers reads every file of additional_chat_templates/: a FIFO there would hang it."""
    from kvsnap.errors import ModelError
    from kvsnap.models.resolve import resolve_model

    folder = tmp_path / "model"
    shutil.copytree(model, folder)
    (folder / "additional_chat_templates").mkdir()
    os.mkfifo(folder / "additional_chat_templates" / "tool_use.jinja")
    with pytest.raises(ModelError, match="tool_use.jinja: model file is a FIFO"):
        within(30, lambda: resolve_model(str(folder)))


def test_an_oversized_small_json_file_is_refused_and_links_to_regular_files_are_fine(model, tmp_path):
    from kvsnap.errors import ModelError
    from kvsnap.models.resolve import SMALL_JSON_LIMIT, resolve_model

    # As in the Hugging Face cache: every file a symlink to a blob elsewhere. It loads and runs.
    blobs, folder = tmp_path / "blobs", tmp_path / "linked"
    shutil.copytree(model, blobs)
    folder.mkdir()
    for path in blobs.iterdir():
        (folder / path.name).symlink_to(path)
    assert resolve_model(str(folder)) == folder
    result = invoke("run", *base(folder), "--prompt", "hi", "--max-new-tokens", "1")
    assert result.exit_code == 0, result.output
    # A generation_config.json transformers would read whole: refused past the bound, as kvsnap's own reads are.
    big = tmp_path / "big"
    shutil.copytree(model, big)
    with open(big / "generation_config.json", "wb") as f:
        f.truncate(SMALL_JSON_LIMIT + 1)
    with pytest.raises(ModelError, match="generation_config.json: model file larger than 16 MiB"):
        resolve_model(str(big))
