"""The chat's autosave runs in the background: the prompt comes back before the file is written, the
exit waits for it, and a failed save is reported at the next prompt with the previous file unchanged.

The chats run in this process (piped stdin) with the file write itself
(``kvsnap.format.atomic.replace_whole``) slowed down or broken, and every prompt noted.
"""

from __future__ import annotations

import builtins
import errno
import hashlib
import sys
import threading

import pytest
from cli_helpers import Ran, kvsnap
from test_chat import base, info, user_messages

from kvsnap.format import atomic


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


class NoSpace(list):
    """Parts of a file whose write fails half way, like a full disk."""

    def __iter__(self):
        yield from self[: len(self) // 2]
        raise OSError(errno.ENOSPC, "No space left on device")


def driven_chat(model, monkeypatch, mode: str, lines: str, *args: str) -> Ran:
    """``kvsnap chat`` whose prompts are noted and whose file writes wait (mode "slow") or fail (mode
    "fail", the second write), each event a ``[driver]`` line in its stderr, in the order they happened."""
    real_replace, real_input = atomic.replace_whole, builtins.input
    prompts = threading.Condition()
    count = {"prompts": 0, "writes": 0}

    def note(text: str) -> None:
        print("[driver] " + text, file=sys.stderr, flush=True)

    def prompt(text=""):
        with prompts:  # noted before a waiting write can go on, so the order of the lines is the order of events
            count["prompts"] += 1
            note(f"prompt {count['prompts']}")
            prompts.notify_all()
        return real_input(text)

    def replace_whole(path, parts, mode_=None):
        count["writes"] += 1
        n = count["writes"]
        if mode == "slow":
            # Save n follows turn n; the prompt after that turn is prompt n + 1. A chat that saves before
            # it prompts again never shows it while this save waits (and the wait ends in a timeout).
            with prompts:
                shown = prompts.wait_for(lambda: count["prompts"] > n, timeout=15)
            note(f"write {n} waited for the prompt: {'shown' if shown else 'timed out'}")
        if mode == "fail" and n == 2:
            note("file before the failing write: " + hashlib.sha256(path.read_bytes()).hexdigest())
            parts = NoSpace(parts)
        size = real_replace(path, parts, mode_)
        note(f"write {n} done")
        return size

    with monkeypatch.context() as patched:
        patched.setattr(atomic, "replace_whole", replace_whole)
        patched.setattr(builtins, "input", prompt)
        ran = kvsnap("chat", *base(model), *args, input=lines)
    assert "Traceback" not in ran.stderr, ran.stderr
    return ran


def driver_lines(stderr: str) -> list[str]:
    return [line.removeprefix("[driver] ") for line in stderr.splitlines() if line.startswith("[driver] ")]


def test_the_prompt_comes_back_before_the_save_and_the_exit_waits_for_it(model, tmp_path, monkeypatch):
    path = tmp_path / "chat.kv"
    proc = driven_chat(model, monkeypatch, "slow", "one\ntwo\n", "--save", str(path))
    assert proc.returncode == 0, proc.stderr
    # Each turn's save was still writing when the next prompt was shown (the last one: the end of input).
    events = driver_lines(proc.stderr)
    assert events == [
        "prompt 1",
        "prompt 2",
        "write 1 waited for the prompt: shown",
        "write 1 done",
        "prompt 3",
        "write 2 waited for the prompt: shown",
        "write 2 done",
    ], proc.stderr
    assert proc.stderr.count(f"tokens to {path}") == 2  # each save is reported once it is done
    # The exit waited for the last save: the file holds the whole conversation, and no temp file is left.
    held = info(path)
    assert [m["content"] for m in held["messages"] if m["role"] == "user"] == ["one", "two"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.kv"]

    # Resumed, the chat has the same history, all of it reused.
    again = kvsnap("chat", *base(model), "--resume", str(path), input="three\n")
    assert again.returncode == 0, again.stderr
    assert f"resumed {held['tokens']:,} tokens from {path}" in again.stderr
    assert "2 earlier turns" in again.stderr
    resumed = info(path)["messages"]
    assert resumed[: len(held["messages"])] == held["messages"]
    assert [m["content"] for m in resumed if m["role"] == "user"] == ["one", "two", "three"]


def test_a_failed_background_save_is_reported_at_the_next_prompt_and_keeps_the_file(model, tmp_path, monkeypatch):
    path = tmp_path / "chat.kv"
    proc = driven_chat(model, monkeypatch, "fail", "one\ntwo\n/help\n", "--save", str(path))
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    # The failure is one error line, shown when the chat next reads (before /help runs), not at exit.
    failures = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(failures) == 1, err
    assert "No space left on device" in failures[0] and "the previous file is unchanged" in failures[0]
    assert "the conversation is kept" in failures[0]
    assert err.index("No space left on device") < err.index("commands:")
    assert driver_lines(err)[-1] == "prompt 4"  # nothing was written after the failure
    # The previous file is intact, byte for byte, and the broken write left no temp file.
    (before,) = [line.split(": ")[1] for line in driver_lines(err) if line.startswith("file before")]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    assert user_messages(path) == ["one"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.kv"]


# -- the library: kvsnap.engine.background_save --------------------------------------------------


@pytest.fixture
def session(tiny_lm):
    from kvsnap.config import SamplingParams
    from kvsnap.engine.session import Session

    s = Session(tiny_lm("llama"), block_size=16)
    s.chat("hello there", SamplingParams(max_new_tokens=6, temperature=0))
    return s


def test_a_background_save_never_runs_the_model_and_writes_what_the_session_held(session, tmp_path):
    """Neither the thread nor ``start``: the answer's last sampled token is left to the next turn."""
    from kvsnap.engine.background_save import BackgroundSaver
    from kvsnap.engine.session import Session

    forwards = []
    handle = session.lm.model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        assert session.pending
        saver = BackgroundSaver(session)
        saver.start(tmp_path / "a.kv")
        assert saver.in_flight
        with pytest.raises(RuntimeError, match="in flight"):
            saver.start(tmp_path / "b.kv")  # one at a time
        saved = saver.wait()
    finally:
        handle.remove()
    assert forwards == []
    assert not saver.in_flight and saver.wait() is None
    assert saved.stats.tokens == len(session.tokens) and list(saved.held.tokens) == session.tokens
    assert saved.stamp is not None and saved.stamp.size == (tmp_path / "a.kv").stat().st_size
    back = Session(session.lm, block_size=16)
    back.restore(tmp_path / "a.kv")
    assert back.tokens == session.tokens and back.messages == session.messages
    assert back.last_logits is not None and back.last_logits.equal(session.last_logits)


def test_wait_raises_the_save_error_once(session, tmp_path):
    from kvsnap.engine.background_save import BackgroundSaver
    from kvsnap.errors import SaveError

    saver = BackgroundSaver(session)
    saver.start(tmp_path / "missing-folder" / "a.kv")
    with pytest.raises(SaveError, match="does not exist"):
        saver.wait()
    assert saver.wait() is None  # collected: the next save may start
    saver.start(tmp_path / "a.kv")
    assert saver.wait().stats.path == str(tmp_path / "a.kv")
