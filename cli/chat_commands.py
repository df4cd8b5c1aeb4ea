"""The chat's /reset and /stats: a new conversation beside the kept one, and what the session holds."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvsnap_cli import ui

if TYPE_CHECKING:
    from kvsnap_cli.chat_keeping import Keeping


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
            n = 2
            while f"{keeping.store_name}-{n}" in names:
                n += 1
            new = f"{keeping.store_name}-{n}"
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
