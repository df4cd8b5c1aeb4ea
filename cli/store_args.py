"""The arguments every ``kvsnap store`` command shares: the store folder, optional and first.

DIR defaults to the one store setting (``$KVSNAP_STORE``, else ``$KVSNAP_HOME/store``; ``common.default_store``).
A command with more arguments (``pin [DIR] NAME``) tells them apart by count: one more than it needs means
the first is DIR.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvsnap_cli.common import default_store

if TYPE_CHECKING:
    from kvsnap.sealing import SealKey
    from kvsnap.store import BlockStore

DIR_HELP = "the block store folder (default: $KVSNAP_STORE, else $KVSNAP_HOME/store)."
Dir = Annotated[Path | None, typer.Argument(metavar="[DIR]", help=f"DIR: {DIR_HELP}", show_default=False)]
Json = Annotated[bool, typer.Option("--json", metavar="", help="Print one JSON object.")]


def args(metavar: str, help: str):
    """A ``[DIR] ...`` argument list: ``metavar`` names what follows DIR."""
    return Annotated[
        list[str], typer.Argument(metavar=f"[DIR] {metavar}", help=f"{help} DIR: {DIR_HELP}", show_default=False)
    ]


def store_dir(path: Path | None) -> Path:
    return path if path is not None else default_store()


def split(given: list[str] | None, *wanted: str) -> tuple[Path, list[str]]:
    """``given`` as (store folder, the values named ``wanted``); a wrong count is a usage error (exit 2)."""
    values = list(given or [])
    if len(values) == len(wanted):
        return default_store(), values
    if len(values) == len(wanted) + 1:
        return Path(values[0]), values[1:]
    raise typer.BadParameter(f"give [DIR] {' '.join(wanted)} ({len(values)} given)")


def open_store(path: Path, *, create: bool = False, key: SealKey | None = None) -> BlockStore:
    from kvsnap.store import BlockStore

    return BlockStore(path, create=create, key=key)
