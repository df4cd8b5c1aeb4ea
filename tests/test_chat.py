"""The chat never loses a conversation: autosave rules, /reset, store sessions, Ctrl-C, input escapes.

Chats read a piped stdin (not a terminal), on a tiny random-weight model. They run in this process
(tests/cli_helpers.py), except where a process is the point: a signal (Ctrl-C), or two chats at once.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cli_helpers import Ran, kvsnap
from typer.testing import CliRunner

from kvsnap_cli.main import app

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


def base(model: str) -> list[str]:
    # --reuse load: these tests are about what a chat keeps, not about load-or-recompute. Under --reuse auto
    # each resume would first measure this machine (seconds, in every test: each has its own cost-model
    # folder), and a measurement on a busy machine may find recomputing the tiny model's prefix faster.
    return ["--model", model, "--device", "cpu", "--block-size", "16", "--temperature", "0", "--max-new-tokens", "6",
            "--reuse", "load"]  # fmt: skip


def chat_cmd(model: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "kvsnap_cli.main", "chat", *base(model), *args]


def chat(model: str, lines: str, *args: str) -> Ran:
    """``kvsnap chat`` in this process, ``lines`` piped in."""
    return kvsnap("chat", *base(model), *args, input=lines)


def info(path: Path) -> dict:
    result = runner.invoke(app, ["inspect", str(path), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def user_messages(path: Path) -> list[str]:
    return [m["content"] for m in info(path).get("messages") or [] if m["role"] == "user"]


def test_a_document_snapshot_is_never_replaced_by_a_chat(model, tmp_path):
    """Guards data loss: `chat --resume report.kv` on a snapshot primed by `run` (no chat history)
    replaced the 81 MB document snapshot with a 65-token chat at the first autosave, asking nothing."""
    doc = tmp_path / "report.kv"
    primed = runner.invoke(
        app, ["run", *base(model), "--prompt", "report text " * 40, "--max-new-tokens", "0", "--save", str(doc)]
    )
    assert primed.exit_code == 0, primed.output
    before = doc.read_bytes()
    result = chat(model, "hello\n", "--resume", str(doc))
    assert result.returncode == 0
    assert doc.read_bytes() == before
    beside = tmp_path / "report-2.kv"
    assert f"saving this chat to {beside} instead" in result.stderr
    assert user_messages(beside) == ["hello"]


def test_reset_keeps_the_old_conversation_and_autosaves_beside_it(model, tmp_path):
    """Guards data loss: /help said the snapshot is kept on /reset, but the next autosave replaced the
    618-token conversation with the new 45-token one."""
    path = tmp_path / "chat.kv"
    result = chat(model, "first talk\n/reset\nsecond talk\n", "--resume", str(path))
    assert result.returncode == 0
    assert f"{path} keeps the previous conversation; this one autosaves to {tmp_path / 'chat-2.kv'}" in result.stderr
    assert user_messages(path) == ["first talk"]
    assert user_messages(tmp_path / "chat-2.kv") == ["second talk"]


def test_autosave_continues_its_own_file(model, tmp_path):
    """The rule must not get in the way: a chat that continues its own snapshot keeps saving there."""
    path = tmp_path / "chat.kv"
    assert chat(model, "one\n", "--resume", str(path)).returncode == 0
    again = chat(model, "two\n/save\n", "--resume", str(path))
    assert again.returncode == 0 and "instead" not in again.stderr
    assert user_messages(path) == ["one", "two"]
    assert not (tmp_path / "chat-2.kv").exists()
    # /save right after the autosave has nothing new to compress (it used to say "1 new block").
    assert again.stderr.strip().splitlines()[-1].count("0 new blocks") == 1


def test_a_second_chat_on_the_same_file_does_not_erase_the_first(model, tmp_path, kvsnap_home):
    """Guards data loss: two chats resumed shared.kv; A saved, then B saved, and A's turn vanished.
    B is another process, kept waiting at its prompt while A (in this process) has its turn."""
    shared = tmp_path / "shared.kv"
    assert chat(model, "common start\n", "--resume", str(shared)).returncode == 0
    env = {**os.environ, "KVSNAP_HOME": str(kvsnap_home)}
    b = subprocess.Popen(
        chat_cmd(model, "--resume", str(shared)),
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        env=env,
    )
    seen = ""
    while "resumed" not in seen:  # B has read shared.kv
        line = b.stderr.readline()
        assert line, seen
        seen += line
    assert chat(model, "turn of A\n", "--resume", str(shared)).returncode == 0
    _, err = b.communicate("turn of B\n", timeout=300)
    assert b.returncode == 0, err
    assert "changed by another program" in err
    assert user_messages(shared) == ["common start", "turn of A"]
    assert user_messages(tmp_path / "shared-2.kv") == ["common start", "turn of B"]


def test_a_named_store_session_resumes(model, tmp_path):
    """Guards: `chat --store S --store-session work` twice reused 0 tokens, moved the name to a second
    conversation, and said "not autosaving" although the chat was recorded in the store."""
    store = tmp_path / "store"
    args = ("--store", str(store), "--store-session", "work")
    first = chat(model, "remember this\n", *args)
    assert first.returncode == 0
    assert "not autosaving" not in first.stderr
    assert f"recording this chat in the store {store} as session 'work'" in first.stderr
    second = chat(model, "and this\n", *args)
    assert second.returncode == 0
    assert "store session 'work'" in second.stderr and "(0 recomputed)" in second.stderr
    assert "1 earlier turn" in second.stderr
    reused = int(second.stderr.split(" prompt tokens: ")[1].split(" reused")[0])
    assert reused > 0
    sessions = json.loads(runner.invoke(app, ["store", "sessions", str(store), "--json"]).stdout)["sessions"]
    assert [(s["name"], s["chat_turns"]) for s in sessions] == [("work", 4)]


def test_messages_that_start_with_a_slash(model, tmp_path):
    """Guards: there was no way to send "/etc is a folder" (it was an unknown command)."""
    path = tmp_path / "c.kv"
    result = chat(model, "//etc is a folder\n/say /usr too\n", "--resume", str(path))
    assert result.returncode == 0 and "unknown command" not in result.stderr
    assert user_messages(path) == ["/etc is a folder", "/usr too"]


def test_a_refused_snapshot_in_a_piped_chat_names_the_way_out(model, tmp_path):
    """Guards a misleading error: the piped refusal did not mention --on-mismatch recompute."""
    bad = tmp_path / "bad.kv"
    bad.write_text("not a snapshot, just text\n" * 10)
    result = chat(model, "hi\n", "--resume", str(bad))
    assert result.returncode == 1
    assert "--on-mismatch recompute" in result.stderr
    assert bad.read_text().startswith("not a snapshot")
    kept = chat(model, "hi\n", "--resume", str(bad), "--on-mismatch", "recompute")
    assert kept.returncode == 0 and bad.read_text().startswith("not a snapshot")
    assert user_messages(tmp_path / "bad-2.kv") == ["hi"]


DRIVER = textwrap.dedent(
    """
    import os, signal, sys, threading
    sys.path.insert(0, {root!r})
    from kvsnap_cli import ui
    from kvsnap.engine.background_save import BackgroundSaver
    from kvsnap.engine.session import Session

    emitted = []
    real_emit, real_save, real_wait = ui.emit, Session.save, BackgroundSaver.wait
    settling = threading.Event()

    def emit(text):  # the first Ctrl-C arrives while the answer streams
        real_emit(text)
        emitted.append(text)
        if len(emitted) == 3:
            os.kill(os.getpid(), signal.SIGINT)

    def wait(self):  # the chat, at the end of its input, waits for the autosave before it exits
        settling.set()
        return real_wait(self)

    def save(self, path, **kw):  # the second one while the interrupted turn is being saved (in the background)
        if not settling.wait(120):  # and the chat waits for that save: the Ctrl-C must be held, not lost
            print("[driver] the chat never waited for its save", file=sys.stderr, flush=True)
            os._exit(3)
        os.kill(os.getpid(), signal.SIGINT)
        return real_save(self, path, **kw)

    ui.emit, Session.save, BackgroundSaver.wait = emit, save, wait
    from kvsnap_cli.main import main
    sys.argv = ["kvsnap", "chat", *sys.argv[1:]]
    main()
    """
)


def test_ctrl_c_twice_still_saves_the_turn_on_screen(model, tmp_path, kvsnap_home):
    """Guards data loss: Ctrl-C twice quickly during an answer exited 130 without autosaving the turn
    already on screen, or said "(interrupted before the answer)" after ~100 tokens were shown."""
    path = tmp_path / "c.kv"
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(root=str(ROOT)))
    args = [a if a != "6" else "40" for a in base(model)]
    env = {**os.environ, "KVSNAP_HOME": str(kvsnap_home)}
    proc = subprocess.run(
        [sys.executable, str(driver), *args, "--resume", str(path)],
        input="tell me more\n",
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "answer interrupted" in proc.stderr and "held until the turn was saved" in proc.stderr
    messages = info(path)["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[1]["content"] and proc.stdout.startswith(messages[1]["content"])


def test_interrupt_before_the_answer_leaves_the_conversation_as_it_was(llama):
    """An interrupt that comes before the answer is kept (the prefill) must not leave KV for a message
    the conversation does not hold."""
    from kvsnap.config import SamplingParams
    from kvsnap.engine.session import Session

    s = Session(llama, block_size=16)
    params = SamplingParams(max_new_tokens=4, temperature=0)
    first = s.chat("first", params)
    tokens, messages = s.all_tokens, list(s.messages)

    def boom(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        s.chat("second", params, on_progress=boom)
    assert s.messages == messages
    assert tokens[: len(s.tokens)] == s.tokens and s.cache.length == len(s.tokens)
    kept = len(s.tokens)
    after = s.chat("second", params)
    # The next turn reuses the KV kept: the first prompt at least (the answer, rendered again by the
    # template, may tokenize otherwise), never more than the session held.
    assert first.prompt_tokens <= after.hit_tokens <= kept
    assert after.prefill_tokens == after.prompt_tokens - after.hit_tokens


def test_a_loop_is_stopped(llama, monkeypatch):
    """Guards a runaway answer ("La USA, la USA, ... LaUSA" until Ctrl-C): a repeating tail ends the answer."""
    from kvsnap.config import SamplingParams
    from kvsnap.engine import runner as runner_mod
    from kvsnap.engine.sampling import is_looping
    from kvsnap.engine.session import Session

    assert is_looping([5, 6, 7] * 11)
    assert is_looping([9] * 32)
    assert not is_looping(list(range(200)))
    assert not is_looping([1, 2, 3] * 5)  # too short to call a loop
    sentence = list(range(100, 115))  # a 15-token line written again and again
    assert is_looping([1, 2] + sentence * 3) and not is_looping([1, 2] + sentence * 2)
    s = Session(llama, block_size=16)
    s.prefill([1, 2, 3, 4])
    tokens = itertools.cycle([11, 12, 13])
    monkeypatch.setattr(runner_mod, "sample", lambda logits, params, generator: next(tokens))
    gen = s.generate(SamplingParams(max_new_tokens=500, temperature=0))
    assert gen.stop_reason == "repetition" and len(gen.token_ids) < 60
    looping = s.generate(SamplingParams(max_new_tokens=50, temperature=0, stop_loops=False))
    assert looping.stop_reason == "length"


def test_terminal_input_reads_a_fenced_block_as_one_message():
    """Guards: a multi-line paste became one turn per line and the first line was answered at once."""
    from kvsnap_cli.chat_input import Command, Message, read_entry

    lines = iter(['"""', "line one", "/not a command", "", "line three", '"""'])
    assert read_entry(lambda prompt: next(lines), interactive=True) == Message("line one\n/not a command\n\nline three")
    # Without a terminal every line stays one message, and the fence is just text.
    piped = iter(['"""'])
    assert read_entry(lambda prompt: next(piped), interactive=False) == Message('"""')
    assert read_entry(lambda prompt: "/save x.kv", interactive=False) == Command("/save", "x.kv")
    assert read_entry(lambda prompt: "//etc", interactive=False) == Message("/etc")
    assert read_entry(lambda prompt: "   ", interactive=False) is None
