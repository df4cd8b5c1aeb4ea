"""``kvsnap chat``: a streaming REPL that resumes from and autosaves to a .kv snapshot (or a store session).

What it promises: an autosave never replaces a snapshot this chat does not continue (another
conversation, a document primed by ``run``, a file someone else saved since) unless the user says
so; it saves beside it instead and says where. Every message names the file that holds what.

The autosave after an answer runs in the background (``kvsnap.engine.background_save``): the prompt
comes back at once. Nothing touches the session until that save is done: the next message or command,
and the exit, wait for it first (Ctrl-C is held meanwhile, so the turn on screen is never lost), and a
save that failed is reported then, with the previous file unchanged (saves are atomic).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Annotated

import typer

from kvsnap.config import CHAT_SAMPLING
from kvsnap_cli import chat_commands, chat_resume, ui
from kvsnap_cli import options as o
from kvsnap_cli.chat_input import Command, InterruptGate, Message, read_entry
from kvsnap_cli.chat_keeping import Keeping
from kvsnap_cli.common import guarded, open_session

# How long the prompt waits for an autosave to finish so its line comes first.
SAVE_NOTE_WAIT_S = 1.0
HELP = """commands:
  /save [FILE]   save now (default: the autosave file); refuses to replace a file this chat does not continue
  /save! [FILE]  save now, replacing the file whatever it holds
  /stats         tokens, reuse and sizes
  /reset         start a new conversation; the autosave file keeps the old one and autosave moves beside it
  /fork [NAME]   branch: write the conversation so far beside the file (or to store session NAME) and go on
                 there; the original stays as it is
  /history       list the turns
  /undo          drop the last exchange (the KV up to the turn before it is kept)
  /say TEXT      send TEXT as a message even if it starts with / (or type //text)
  /exit          quit (Ctrl-D too)
  /help          this list
input: one message per line; in a terminal, a line holding only \"\"\" starts and ends a multi-line message"""


@guarded
@o.session_options(CHAT_SAMPLING, model_defaults=True)
def chat(
    resume: Annotated[
        Path | None,
        typer.Option(metavar="FILE", help="Resume this snapshot (a new one if missing).", rich_help_panel=o.SNAPSHOT),
    ] = None,
    save: Annotated[
        Path | None,
        typer.Option(metavar="FILE", help="Autosave here (default: the --resume file).", rich_help_panel=o.SNAPSHOT),
    ] = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            metavar="",
            help="Let the autosave replace another conversation.",
            rich_help_panel=o.SNAPSHOT,
        ),
    ] = False,
    on_mismatch: Annotated[
        str,
        typer.Option(
            metavar="HOW",
            help="If the --resume snapshot is refused: ask (error when not a terminal), error, recompute. If its KV "
            "fails the --verify check, ask and recompute keep the conversation and compute its KV again.",
            rich_help_panel=o.ADVANCED,
            hidden=True,
        ),
    ] = "ask",
    system: Annotated[
        str | None,
        typer.Option(metavar="TEXT", help="System message of a new conversation.", rich_help_panel=o.GENERATION),
    ] = None,
    *,
    opts: o.SessionOptions,
) -> None:
    """Chat with a local model; the conversation's KV cache is saved after every turn and resumed for free.

    One message per line, from a terminal or a pipe; /exit or end of input ends the chat, /help lists the
    commands. --help-all shows every option.
    """
    from kvsnap.config import ON_MISMATCH, check_choice
    from kvsnap.engine.background_save import BackgroundSaver
    from kvsnap.errors import ConfigError, SnapshotError
    from kvsnap.format.save_target import AutosaveTarget, Held
    from kvsnap_cli.batch import check_save_target

    check_choice("--on-mismatch", on_mismatch, ("ask", *ON_MISMATCH))
    session_config = opts.session_config(resume)
    check_save_target(save or resume, foreign=False)  # a file a chat cannot extend is saved beside, not replaced
    if opts.store_session is not None and opts.store is None:
        raise ConfigError("--store-session needs --store DIR")
    opts.sampling()  # a bad flag is refused before the model loads
    interactive = sys.stdin.isatty()
    # A refused verify keeps the conversation and computes its KV again (recompute, or ask in a terminal:
    # nothing is lost), else it is an error.
    verify_mode = "recompute" if on_mismatch == "recompute" or (on_mismatch == "ask" and interactive) else "error"
    session_config = dataclasses.replace(session_config, on_mismatch=verify_mode)
    prefetch = resume if resume and resume.exists() else None
    session = open_session(opts, session_config, workload="chat", prefetch=prefetch)
    params = opts.sampling(model_defaults=session.lm.sampling_defaults)
    autosave = save or resume
    seen = None  # the tokens of the autosave file, when this chat resumed it
    if resume is not None and not resume.exists():
        ui.note(f"{resume} does not exist yet: starting a new session")
    elif resume is not None:
        try:
            stats = session.restore(resume)
        except SnapshotError as exc:
            force = chat_resume.refused(exc, on_mismatch, interactive, autosave) or force
        else:
            ui.note(ui.resume_line(stats, decided=session.last_reuse))
            chat_resume.describe_history(session, resume, autosave)
            seen = Held.of(session.tokens, session.messages) if autosave == resume else None
            chat_resume.verify(session, stats)
            chat_resume.fit_context(session, params, str(resume))
    elif opts.store_session is not None:
        stats = session.restore_store_session(opts.store_session)
        if stats is not None:
            ui.note(ui.resume_line(stats, decided=session.last_reuse))
            chat_resume.describe_history(session, None, autosave)
            chat_resume.verify(session, stats)
            chat_resume.fit_context(session, params, f"store session {opts.store_session!r}")
    target = AutosaveTarget(autosave, seen=seen) if autosave is not None else None
    keeping = Keeping(target, opts.store_session, force, BackgroundSaver(session))
    _say_where(keeping, opts.store)
    from kvsnap.engine.prepare import preload

    preload(session.lm)  # the chat template's tokenizer and packed weights, while the user types
    if interactive:
        import readline  # noqa: F401  (line editing and history for input())

        ui.note("type a message, /help for commands, Ctrl-C stops an answer, Ctrl-D quits")
    _loop(session, params, keeping, interactive, system)


def _loop(session, params, keeping: Keeping, interactive: bool, system: str | None) -> None:
    gate = InterruptGate()
    try:
        while True:
            try:
                if not _step(session, params, keeping, interactive, system, gate):
                    return
            except KeyboardInterrupt:  # at the prompt (or anywhere between turns): the chat goes on
                ui.emit("\n")
                ui.note("(/exit or Ctrl-D to quit)")
    finally:
        _settle(keeping, gate)  # /exit, end of input, an error: the autosave in flight is finished first


def _step(session, params, keeping: Keeping, interactive: bool, system: str | None, gate: InterruptGate) -> bool:
    """Read one message or command and act on it; returns False to quit."""
    # The autosave usually takes a fraction of a second: its line is printed before the next prompt, not
    # under the message typed next. A slower one is reported once it is done, the prompt does not wait.
    # Ctrl-C meanwhile is held, as in any wait for the save (an interrupted join could lose its result).
    if keeping.saver.in_flight:
        with gate.holding():
            done = keeping.saver.finished_within(SAVE_NOTE_WAIT_S)
        if done:
            _settle(keeping, gate, held=gate.held)
        elif gate.held:  # a Ctrl-C at the prompt, as below
            ui.note("(/exit or Ctrl-D to quit)")
    try:
        entry = read_entry(input, interactive)
    except EOFError:
        if interactive:
            ui.emit("\n")
        return False
    if entry is None:
        return True
    # Whatever comes next may change the session (a turn crops and rewrites the cache), so the
    # autosave in flight, which reads it, is finished first (see kvsnap.engine.background_save).
    if _settle(keeping, gate) and isinstance(entry, Message):
        ui.note("(the message was not sent)")
        return True
    if isinstance(entry, Command):
        return _command(entry, session, keeping, interactive)
    with gate.turn():
        _turn(entry.text, session, params, keeping, interactive, system, gate)
    if gate.held:
        ui.note("(Ctrl-C was held until the turn was recorded)")
    return True


def _turn(text: str, session, params, keeping: Keeping, interactive: bool, system: str | None, gate) -> None:
    """One message and its answer, then the autosave; Ctrl-C stops the answer but never loses the turn."""
    from kvsnap.errors import ContextFullError

    before = session.messages
    try:
        with ui.prefill_progress() as progress:
            result = session.chat(
                text, params, system=system, on_text=ui.emit, on_progress=progress, store_session=keeping.store_name
            )
    except ContextFullError as exc:  # nothing changed: the chat goes on without this message
        gate.stop_interrupting()
        ui.error(f"{exc}; the message was not sent")
        return
    except KeyboardInterrupt:
        gate.stop_interrupting()
        ui.emit("\n")
        if session.messages is before:
            ui.note("(interrupted before the answer: the conversation is as it was before this message)")
            return
        ui.note("(interrupted while recording the turn: the answer is kept)")
    else:
        gate.stop_interrupting()
        ui.emit("\n")
        if result.stop_reason == "interrupted":
            ui.note("(answer interrupted: the conversation keeps the part shown)")
        if result.dropped_turns:
            ui.note(
                ui.dropped_line(
                    result.dropped_turns,
                    chat_resume.count_turns(session.view_messages),
                    chat_resume.count_turns(session.messages),
                )
            )
        ui.note(ui.turn_stats(result))
        if result.verify is not None:
            ui.note(ui.verify_line(result.to_dict()))
        if result.miss is not None and result.miss["cause"] != "none":  # --explain: a turn reused less than it held
            for line in ui.miss_lines(result.miss):
                ui.note(line)
        for line in ui.rerender_lines(result.rerender) if result.rerender is not None else ():
            ui.note(line)
        if result.store_error:
            ui.note(f"warning: {result.store_error}")
    if keeping.target is not None:
        _autosave(session, keeping, interactive, background=True)


def _say_where(keeping: Keeping, store: Path | None) -> None:
    if keeping.store_name is not None:
        ui.note(f"recording this chat in the store {store} as session {keeping.store_name!r} after every turn")
    if keeping.target is None and keeping.store_name is None:
        ui.note("not autosaving (use --save FILE or /save FILE)")


def _autosave(session, keeping: Keeping, interactive: bool, *, background: bool = False) -> None:
    """Save to the autosave file, unless that would replace a conversation this chat does not continue:
    then ask (terminal) or save beside it (no terminal), and say which file holds what. The question is
    asked here, on the main thread; with ``background`` only the write itself runs in a thread."""
    from kvsnap.format.save_target import AutosaveTarget, beside

    target = keeping.target
    conflict = None if keeping.force else target.conflict(session.all_tokens, session.messages)
    if conflict is not None:
        other = beside(target.path)
        choice = "b"
        if interactive:
            choice = _ask(
                f"{conflict.reason}. [o]verwrite it, save [b]eside it as {other}, or [s]kip this save? [b] ", "obs", "b"
            )
        if choice == "s":
            ui.note(f"not saved; {target.path} is unchanged")
            return
        if choice == "b":
            ui.note(f"{conflict.reason}: saving this chat to {other} instead, and autosaving there from now on")
            keeping.target = target = AutosaveTarget(other)
    if background:
        keeping.saving_to = target
        keeping.saver.start(target.path)
    else:
        _save(session, target)


def _save(session, target) -> bool:
    """Save, and on failure say why and keep chatting: the conversation is still in memory."""
    from kvsnap.errors import KvsnapError

    try:
        # Like the autosave (kvsnap.engine.background_save), the answer's last sampled token is left to the
        # next turn: saving it would run the model first, and a /save after an autosave would encode again.
        stats = session.save(target.path, flush=False)
    except KvsnapError as exc:
        _save_failed(exc)
        return False
    target.saved(session.tokens, session.messages)
    ui.note(ui.save_line(stats))
    return True


def _save_failed(exc: Exception) -> None:
    ui.error(f"{exc} (the conversation is kept; /save FILE to save elsewhere)")


def _settle(keeping: Keeping, gate: InterruptGate, held: bool = False) -> bool:
    """Wait for the autosave in flight, if any, with Ctrl-C held (the turn on screen must not be lost),
    and say how it went: a failure is one error line, and the previous file is unchanged. Returns True
    when a Ctrl-C was held meanwhile (``held``: one was held in an earlier wait for this save)."""
    from kvsnap.errors import KvsnapError

    if not keeping.saver.in_flight:
        return False
    saved = None
    with gate.holding():
        try:
            saved = keeping.saver.wait()
        except KvsnapError as exc:
            _save_failed(exc)
    if saved is not None:
        keeping.saving_to.saved(saved.held.tokens, saved.held.messages, stamp=saved.stamp)
        ui.note(ui.save_line(saved.stats))
    held = held or gate.held
    if held:
        ui.note("(Ctrl-C was held until the turn was saved)")
    return held


def _ask(question: str, choices: str, default: str) -> str:
    try:
        answer = input(question).strip().lower()[:1]
    except (EOFError, KeyboardInterrupt):
        return default
    return answer if answer and answer in choices else default


def _command(cmd: Command, session, keeping: Keeping, interactive: bool) -> bool:
    """Handle a slash command; returns False to quit."""
    from kvsnap.format.save_target import AutosaveTarget

    name, arg = cmd.name, cmd.arg
    if name in ("/exit", "/quit"):
        return False
    if name == "/help":
        ui.note(HELP)
    elif name in ("/save", "/save!"):
        if not arg:
            if keeping.target is None:
                ui.error(f"{name} needs a file name (no autosave file was given)")
            elif name == "/save!":
                _save(session, keeping.target)
            else:
                _autosave(session, keeping, interactive)
            return True
        target = AutosaveTarget(Path(arg).expanduser())
        conflict = target.conflict(session.all_tokens, session.messages) if name == "/save" else None
        if conflict is not None:
            ui.error(f"{conflict.reason}; /save! {arg} replaces it")
        else:
            _save(session, target)
    elif name == "/stats":
        chat_commands.stats(session, keeping)
    elif name == "/reset":
        chat_commands.reset(session, keeping)
    elif name == "/fork":
        chat_commands.fork(session, keeping, arg or None, save=lambda target: _save(session, target))
    elif name == "/history":
        chat_commands.history(session)
    elif name == "/undo":
        chat_commands.undo(session, keeping, save=lambda target: _save(session, target))
    else:
        ui.error(f"unknown command {name} (/help lists them; //text or /say TEXT sends a message starting with /)")
    return True
