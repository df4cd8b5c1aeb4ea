"""``kvsnap chat``: a streaming REPL that resumes from and autosaves to a .kv snapshot."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from cli import options as o
from cli import ui
from cli.common import guarded, open_session

HELP = """commands:
  /save [FILE]  save the session now (default: the autosave file)
  /stats        tokens, reuse and sizes
  /reset        forget the conversation (the snapshot file is kept)
  /exit         quit (Ctrl-D too)
  /help         this list"""


@guarded
def chat(
    model: o.Model = "smollm2-135m",
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
    max_new_tokens: o.MaxNewTokens = 512,
    temperature: o.Temperature = 0.7,
    top_p: o.TopP = 0.95,
    top_k: o.TopK = 0,
    seed: o.Seed = None,
    chunk_size: o.ChunkSize = 512,
    namespace: o.Namespace = "",
    store: o.Store = None,
    store_budget: o.StoreBudget = None,
    store_session: o.StoreSession = None,
    block_size: o.BlockSize = 64,
    codec: o.Codec = "shuffle-zstd",
    kv_dtype: o.KvDtype = None,
    device: o.Device = "auto",
    dtype: o.Dtype = "auto",
) -> None:
    """Chat with a local model; the conversation's KV cache is saved after every turn and resumed for free.

    Reads one message per line. When stdin is not a terminal (a pipe or a file), each line is a
    user message and /exit or end of input ends the chat.
    """
    from kvsnap.errors import ConfigError, SnapshotError
    from kvsnap.jobs import check_save_target
    from kvsnap.runner import SamplingParams
    from kvsnap.session import check_codec

    if on_mismatch not in ("ask", "error", "recompute"):
        raise ConfigError(f"--on-mismatch must be ask, error or recompute, not {on_mismatch!r}")
    check_codec(codec)
    check_save_target(save or resume)
    if store_session is not None and store is None:
        raise ConfigError("--store-session needs --store DIR")

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    session = open_session(
        model,
        device,
        dtype,
        store,
        store_budget,
        chunk_size=chunk_size,
        block_size=block_size,
        codec=codec,
        namespace=namespace,
        kv_dtype=kv_dtype,
    )
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
                    text, params, system=system, on_text=ui.emit, on_progress=progress, store_session=store_session
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
