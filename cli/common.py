"""How every command fails: one line on stderr and exit 1 for a ``KvsnapError``, a traceback only with --debug."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import typer

from cli import ui
from kvsnap.errors import KvsnapError

state = {"debug": os.environ.get("KVSNAP_DEBUG") == "1"}


def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except KvsnapError as exc:
            if state["debug"]:
                raise
            ui.error(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            if state["debug"]:
                raise
            ui.note("interrupted")
            raise typer.Exit(130) from None

    return wrapper


def open_store(path, budget: str | None):
    """The block store behind --store/--store-budget, or None."""
    if path is None:
        if budget is not None:
            from kvsnap.errors import ConfigError

            raise ConfigError("--store-budget needs --store DIR")
        return None
    from kvsnap.store import BlockStore, parse_size

    return BlockStore(path, budget_bytes=parse_size(budget) if budget is not None else None)


def open_session(model: str, device: str, dtype: str, store, store_budget: str | None, **options: Any):
    """The Session ``chat`` and ``run`` work with: the block store opened, then the model loaded."""
    from kvsnap.session import Session

    block_store = open_store(store, store_budget)
    return Session(ui.load_model(model, device, dtype), store=block_store, **options)
