"""Where a chat keeps its conversation: an autosave file, a named store session, both or neither."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Keeping:
    """Where the conversation is kept: an autosave file, a named store session, both or neither."""

    target: object | None  # kvsnap.format.save_target.AutosaveTarget
    store_name: str | None
    force: bool  # the user allowed replacing the autosave file whatever it holds
    saver: object  # kvsnap.engine.background_save.BackgroundSaver: the autosave in flight, if any
    saving_to: object | None = None  # the AutosaveTarget of that save
