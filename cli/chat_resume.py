"""What a chat says and checks as it resumes a conversation: its history, the spot check of the
restored KV, a snapshot that does not fit the context, a snapshot that is refused."""

from __future__ import annotations

from pathlib import Path

import typer

from kvsnap_cli import ui


def count_turns(messages) -> int:
    return sum(1 for m in messages or () if m["role"] == "user")


def fit_context(session, params, source: str) -> None:
    """A resumed conversation larger than the context: the same turns leave the model's view as a turn
    would drop, said in one line, before anything runs."""
    from kvsnap.engine.chat_view import context_of, fit_held

    refit = fit_held(session, params.max_new_tokens)
    if refit is not None:
        in_view = (count_turns(session.view_messages), count_turns(session.messages)) if session.messages else None
        ui.note(ui.refit_line(refit, source, context_of(session.lm), in_view))


def describe_history(session, path: Path | None, autosave: Path | None) -> None:
    if session.messages:
        turns = count_turns(session.messages)
        hidden = turns - count_turns(session.view_messages)
        out = f" ({hidden:,} of them out of the model's view: the context was full)" if hidden else ""
        ui.note(f"{ui.plural(turns, 'earlier turn')}{out}; last answer: {last_answer(session.messages)}")
    elif path is not None:
        kept = f"; {path} is replaced only by a conversation that continues it" if autosave == path else ""
        ui.note(f"{path} has no chat history: its tokens are reused where the conversation matches them{kept}")


def verify(session, stats) -> None:
    """Spot check the resumed KV (--verify, or by default when other versions or another device made it)."""
    from kvsnap.errors import VerifyError

    try:
        report = session.verify_restored(stats)
    except VerifyError as exc:
        raise VerifyError(f"{exc} (--on-mismatch recompute computes the conversation's KV again)") from None
    if report is None:
        return
    if report.refused is not None:
        ui.note(f"{report.refused}: the conversation is kept and its KV computed again on the next turn")
    else:
        ui.note(ui.verify_line(report.ledger()))


def refused(exc: Exception, policy: str, interactive: bool, autosave: Path | None) -> bool:
    """A snapshot that cannot be used: stop, or (when allowed) start over. Returns True when the user
    agreed that the autosave may replace the refused file."""
    if policy == "ask" and interactive:
        ui.error(str(exc))
        where = f"; the next autosave replaces {autosave}" if autosave is not None else ""
        try:
            answer = input(f"start a new conversation instead{where}? [y/N] ").strip().lower()
        except (EOFError, KeyboardInterrupt):
            answer = ""
        if answer not in ("y", "yes"):
            raise typer.Exit(1)
        return True
    if policy != "recompute":
        raise type(exc)(f"{exc} (--on-mismatch recompute starts a new conversation and keeps the file)")
    ui.error(f"{exc} (starting a new conversation; the file is kept)")
    return False


def last_answer(messages: list[dict[str, str]]) -> str:
    for m in reversed(messages):
        if m["role"] == "assistant":
            text = " ".join(m["content"].split())
            return ui.printable(text if len(text) <= 80 else text[:77] + "...")
    return "-"
