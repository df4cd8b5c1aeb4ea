"""The chat's /reset, /stats, /fork, /history and /undo: a new conversation or a branch beside the kept
one, what the session holds, its turns, and taking the last exchange back."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kvsnap_cli import ui

if TYPE_CHECKING:
    from kvsnap_cli.chat_keeping import Keeping


def _free_store_name(names: set[str], name: str) -> str:
    n = 2
    while f"{name}-{n}" in names:
        n += 1
    return f"{name}-{n}"


def reset(session, keeping: Keeping) -> None:
    """A new conversation: where the old one was kept, it stays; the new one is kept beside it."""
    from kvsnap.format.save_target import AutosaveTarget, beside

    session.reset()
    said = ["conversation reset"]
    target = keeping.target
    if target is not None and target.path.exists():
        keeping.target = AutosaveTarget(beside(target.path))
        keeping.force = False
        said.append(f"{target.path} keeps the previous conversation; this one autosaves to {keeping.target.path}")
    if keeping.store_name is not None and session.store is not None:
        names = {s.name for s in session.store.sessions()}
        if keeping.store_name in names:
            new = _free_store_name(names, keeping.store_name)
            said.append(f"store session {keeping.store_name!r} keeps the previous conversation; this one is {new!r}")
            keeping.store_name = new
    ui.note("; ".join(said))


def stats(session, keeping: Keeping) -> None:
    from kvsnap.engine.prepare import forward_kind

    layout = session.lm.layout
    turns = sum(1 for m in (session.messages or []) if m["role"] == "user")
    shown = sum(1 for m in (session.view_messages or []) if m["role"] == "user")
    hidden = f", {turns - shown:,} out of the model's view" if shown < turns else ""
    # Counted as a save counts them: the answer's last sampled token has no KV yet (the next turn runs it).
    held = len(session.tokens)
    pending = session.num_tokens - held
    waiting = f" + {ui.plural(pending, 'answer token')} the next message runs first" if pending else ""
    ui.note(
        f"{held:,} tokens in the session ({ui.plural(turns, 'turn')}{hidden}){waiting}, raw KV "
        f"{ui.human_bytes(held * layout.bytes_per_token)}, model {session.lm.name} "
        f"on {session.lm.device} ({layout.dtype}, {forward_kind(session.lm)}), "
        f"forward saw {session.runner.tokens_seen:,} tokens so far"
    )
    path = keeping.target.path if keeping.target is not None else None
    if path is not None and path.exists():
        ui.note(f"autosave file {path}: {ui.human_bytes(path.stat().st_size)}")
    if keeping.store_name is not None:
        ui.note(f"recorded in the store as session {keeping.store_name!r}")


def fork(session, keeping: Keeping, name: str | None, save: Callable[[object], bool]) -> None:
    """Write the conversation so far to a new place and keep it there from now on: store session ``name``
    (default: the next free ``NAME-2``, ...) when the chat records a store session, else the file ``name``
    (a bare name sits beside the autosave file) or the first free one beside it. The original is left
    as the last autosave wrote it."""
    from kvsnap.errors import KvsnapError
    from kvsnap.format.save_target import AutosaveTarget, beside

    if not session.messages:
        ui.error("/fork: nothing to branch yet (send a message first)")
        return
    if keeping.store_name is not None and session.store is not None:
        names = {s.name for s in session.store.sessions()}
        new = name or _free_store_name(names, keeping.store_name)
        if new in names:
            ui.error(f"/fork: store session {new!r} exists; pick another name")
            return
        try:
            session.store_session(new)
        except KvsnapError as exc:
            ui.error(f"/fork: {exc}")
            return
        ui.note(
            f"forked: store session {keeping.store_name!r} keeps the conversation so far; this chat goes on as {new!r}"
        )
        keeping.store_name = new
        name = None  # the name was the store session's; a file branches beside its original
    old = keeping.target.path if keeping.target is not None else None
    if old is None and name is None:
        if keeping.store_name is None:
            ui.error("/fork needs a file name (no autosave file or store session was given)")
        return
    path = Path(name).expanduser() if name is not None else beside(old)
    if name is not None and old is not None and os.sep not in name:
        path = old.with_name(path.name if path.suffix else f"{path.name}.kv")
    if os.path.lexists(path):
        ui.error(f"/fork: {path} exists; pick another name")
        return
    target = AutosaveTarget(path)
    if save(target):
        kept = f"{old} keeps the conversation so far; " if old is not None else ""
        ui.note(f"forked: {kept}this chat goes on in {path}")
        keeping.target = target
        keeping.force = False


def history(session) -> None:
    """The turns, oldest first; those out of the model's view are marked."""
    from kvsnap.conversation import exchanges

    turns = exchanges(session.messages or [])
    if not turns:
        ui.note("no turns yet")
        return
    hidden = len(turns) - sum(1 for m in (session.view_messages or []) if m["role"] == "user")
    for number, asked, answer in turns:
        mark = " (out of view)" if number <= hidden else ""
        ui.note(f"{number:>3}. you: {_clip(asked)}{mark}")
        ui.note(f"     model: {_clip(answer)}")


def _clip(text: str, width: int = 70) -> str:
    line = " ".join(text.split())
    return ui.printable(line if len(line) <= width else line[: width - 3] + "...")


def undo(session, keeping: Keeping, save: Callable[[object], bool]) -> None:
    """Drop the last exchange; where the chat is kept (the file it last wrote, its store session) is
    brought to the shorter conversation at once."""
    from kvsnap.engine.chat import undo as drop_last
    from kvsnap.errors import KvsnapError

    target = keeping.target
    # The file may be rewritten shorter only if it is still what this chat continues.
    ours = target is not None and target.path.exists() and target.conflict(session.all_tokens, session.messages) is None
    if not drop_last(session):
        ui.error("/undo: no exchange to drop")
        return
    turns = sum(1 for m in (session.messages or []) if m["role"] == "user")
    ui.note(f"dropped the last exchange: {ui.plural(turns, 'turn')} left, {session.num_tokens:,} tokens kept")
    if ours:
        save(target)
    if keeping.store_name is not None and session.store is not None:
        try:
            session.store_session(keeping.store_name)
        except KvsnapError as exc:
            ui.note(f"warning: block store not updated: {exc}")
