"""``kvsnap chat``: a streaming REPL that resumes from and autosaves to a .kv snapshot."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from cli import options as o
from cli import ui
from cli.common import guarded, open_session
from kvsnap.config import CHAT_SAMPLING

HELP = """commands:
  /save [FILE]  save the session now (default: the autosave file)
  /stats        tokens, reuse and sizes
  /reset        forget the conversation (the snapshot file is kept)
  /exit         quit (Ctrl-D too)
  /help         this list"""


@guarded
@o.session_options(CHAT_SAMPLING)
def chat(
    resume: Annotated[
        Path | None, typer.Option(help="Resume this snapshot (started fresh if it does not exist).")
    ] = None,
    save: Annotated[
        Path | None, typer.Option(help="Autosave here after every turn (default: the --resume file).")
    ] = None,
    on_mismatch: Annotated[
        str,
        typer.Option(help="If the --resume snapshot is refused: ask (error when not a terminal), error, recompute."),
    ] = "ask",
    system: Annotated[str | None, typer.Option(help="System message for a new conversation.")] = None,
    *,
    opts: o.SessionOptions,
) -> None:
    """Chat with a local model; the conversation's KV cache is saved after every turn and resumed for free.

    Reads one message per line. When stdin is not a terminal (a pipe or a file), each line is a
    user message and /exit or end of input ends the chat.
    """
    from cli.batch import check_save_target
    from kvsnap.config import ON_MISMATCH, check_choice
    from kvsnap.errors import ConfigError, SnapshotError

    check_choice("--on-mismatch", on_mismatch, ("ask", *ON_MISMATCH))
    session_config = opts.session_config()
    check_save_target(save or resume)
    if opts.store_session is not None and opts.store is None:
        raise ConfigError("--store-session needs --store DIR")
    params = opts.sampling()
    session = open_session(opts, session_config)
    autosave = save or resume
    interactive = sys.stdin.isatty()
    if resume is not None and not resume.exists():
        ui.note(f"{resume} does not exist yet: starting a new session")
    elif resume is not None:
        try:
            stats = session.restore(resume)
        except SnapshotError as exc:
            _refused(exc, on_mismatch, interactive, autosave)
        else:
            ui.note(ui.resume_line(stats, recomputed=0))
            if session.messages:
                turns = sum(1 for m in session.messages if m["role"] == "user")
                ui.note(
                    f"{turns} earlier turn{'s' if turns != 1 else ''}; last answer: {_last_answer(session.messages)}"
                )
            else:
                ui.note("the snapshot has no chat history; its tokens are reused where the conversation matches them")
    if autosave is None:
        ui.note("not autosaving (use --save FILE or /save FILE)")
    if interactive:
        import readline  # noqa: F401  (line editing and history for input())

        ui.note("type a message, /help for commands, Ctrl-C stops an answer, Ctrl-D quits")

    while True:
        try:
            line = input(">>> " if interactive else "")
        except EOFError:
            if interactive:
                ui.emit("\n")
            break
        except KeyboardInterrupt:
            ui.emit("\n")
            ui.note("(/exit or Ctrl-D to quit)")
            continue
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            if not _command(text, session, autosave, system):
                break
            continue
        try:
            with ui.prefill_progress() as progress:
                result = session.chat(
                    text, params, system=system, on_text=ui.emit, on_progress=progress, store_session=opts.store_session
                )
        except KeyboardInterrupt:
            # Interrupted while reading the message in: the session is as it was before it.
            ui.emit("\n")
            ui.note("(interrupted before the answer; the message was not added)")
            continue
        ui.emit("\n")
        if result.stop_reason == "interrupted":
            ui.note("(answer interrupted; the session keeps what was generated)")
        ui.note(ui.turn_stats(result))
        if autosave is not None:
            _save(session, autosave)


def _refused(exc: Exception, policy: str, interactive: bool, autosave: Path | None) -> None:
    """A snapshot that cannot be used: stop, or (when allowed) start over without touching the file yet."""
    if policy == "ask" and interactive:
        ui.error(str(exc))
        where = f"; the next autosave replaces {autosave}" if autosave is not None else ""
        try:
            answer = input(f"start a new conversation instead{where}? [y/N] ").strip().lower()
        except (EOFError, KeyboardInterrupt):
            answer = ""
        if answer not in ("y", "yes"):
            raise typer.Exit(1)
    elif policy != "recompute":
        raise exc
    else:
        ui.error(f"{exc} (starting a new conversation)")


def _save(session, target: Path) -> None:
    """Save, and on failure say why and keep chatting: the conversation is still in memory."""
    from kvsnap.errors import KvsnapError

    try:
        ui.note(ui.save_line(session.save(target)))
    except KvsnapError as exc:
        ui.error(f"{exc} (the conversation is kept; /save FILE to save elsewhere)")


def _command(text: str, session, autosave: Path | None, system: str | None) -> bool:
    """Handle a slash command; returns False to quit."""
    name, _, arg = text.partition(" ")
    arg = arg.strip()
    if name in ("/exit", "/quit"):
        return False
    if name == "/help":
        ui.note(HELP)
    elif name == "/save":
        target = Path(arg).expanduser() if arg else autosave
        if target is None:
            ui.error("/save needs a file name (no autosave file was given)")
        else:
            _save(session, target)
    elif name == "/stats":
        layout = session.lm.layout
        turns = sum(1 for m in (session.messages or []) if m["role"] == "user")
        ui.note(
            f"{session.num_tokens:,} tokens in the session ({turns} turn{'s' if turns != 1 else ''}), raw KV "
            f"{ui.human_bytes(session.num_tokens * layout.bytes_per_token)}, model {session.lm.name} "
            f"on {session.lm.device} ({layout.dtype}), forward saw {session.runner.tokens_seen:,} tokens so far"
        )
        if autosave is not None and autosave.exists():
            ui.note(f"autosave file {autosave}: {ui.human_bytes(autosave.stat().st_size)}")
    elif name == "/reset":
        session.reset()
        ui.note("conversation reset")
    else:
        ui.error(f"unknown command {name} (/help lists them)")
    return True


def _last_answer(messages: list[dict[str, str]]) -> str:
    for m in reversed(messages):
        if m["role"] == "assistant":
            text = " ".join(m["content"].split())
            return text if len(text) <= 80 else text[:77] + "..."
    return "-"
