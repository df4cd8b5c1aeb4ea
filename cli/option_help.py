"""How the shared options show in --help: panels, the advanced ones folded away, defaults said inline."""

from __future__ import annotations

import copy
from typing import Annotated, Any

import typer

# --help groups options by what they are about; the rare ones (ADVANCED) are hidden from chat's and run's
# --help, so it fits a screen, and shown by --help-all.
MODEL, GENERATION, SNAPSHOT, STORE, OUTPUT, ADVANCED = "Model", "Generation", "Snapshot", "Store", "Output", "Advanced"


def _help_all(ctx: typer.Context, value: bool) -> None:
    """--help-all: the help with the ADVANCED options shown too."""
    if not value or ctx.resilient_parsing:
        return
    for param in ctx.command.params:
        param.hidden = False
    typer.echo(ctx.get_help(), nl=False)
    raise typer.Exit()


HelpAll = Annotated[
    bool,
    typer.Option(
        "--help-all", metavar="", is_eager=True, callback=_help_all, help="Show every option, the advanced ones too."
    ),
]
PANELS = ("Input", MODEL, GENERATION, SNAPSHOT, STORE, OUTPUT, ADVANCED)


def panel(annotation: Any) -> str | None:
    info = annotation.__metadata__[0] if hasattr(annotation, "__metadata__") else None
    return getattr(info, "rich_help_panel", None)


def folded(flag: Any) -> Any:
    """``flag`` hidden from --help when it belongs to the ADVANCED panel (--help-all shows it)."""
    if panel(flag) != ADVANCED:
        return flag
    info = copy.copy(flag.__metadata__[0])
    info.hidden = True
    return Annotated[flag.__origin__, info]


def default_said(flag: Any, default: Any) -> Any:
    """``flag`` with its (per command) default in its one line of help instead of on a line of its own."""
    info = copy.copy(flag.__metadata__[0])
    info.help = f"{info.help[:-1]} (default {default})."
    info.show_default = False
    return Annotated[flag.__origin__, info]


def model_default(flag: Any, fallback: float) -> Any:
    """``flag`` made optional: unset means the model's generation_config.json value, else ``fallback``."""
    base, info = flag.__origin__, flag.__metadata__[0]
    info = copy.copy(info)
    info.help = f"{info.help[:-1]} (default: the model's, else {fallback:g})."
    return Annotated[base | None, info]
