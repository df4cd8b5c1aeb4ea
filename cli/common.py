"""How every command fails: one line on stderr and exit 1 for a ``KvsnapError``, a traceback only with --debug."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from kvsnap.errors import KvsnapError
from kvsnap_cli import startup, ui

if TYPE_CHECKING:
    from kvsnap.config import SessionConfig
    from kvsnap_cli.options import SessionOptions

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
    from kvsnap.store import BlockStore, StoreError
    from kvsnap_cli.options import parse_size

    budget_bytes = parse_size(budget) if budget is not None else None
    store = BlockStore(path)  # a folder that is not a store (a mistyped path) is an error, as it should be
    if budget_bytes is not None:
        try:
            store.set_budget(budget_bytes)
        except StoreError as exc:
            # A store that cannot be written (a full disk) still serves what it holds: runs warn, not fail.
            ui.note(f"warning: --store-budget not applied ({exc})")
    return store


def open_session(
    opts: SessionOptions,
    session_config: SessionConfig | None = None,
    *,
    reuses: bool = False,
    prefetch: Path | None = None,
    many_forwards: bool = False,
):
    """The Session ``chat`` and ``run`` work with: settings checked, the block store opened, then the model
    loaded. ``reuses``: a stored prefix may be loaded (--resume, --store, a batch), so ``--reuse auto``
    needs this machine's cost model: measured now, once, with progress, rather than silently mid-request.
    ``prefetch``: a snapshot the session will restore, read and decoded in a thread while the model loads
    (kvsnap.format.prefetch; the restore claims it only if it is still that file). ``many_forwards``
    (a chat, a batch): reserve the KV memory of ``--ctx-size`` now, unless a prefetch already holds it."""
    session_config = session_config or opts.session_config()
    if prefetch is not None and not str(opts.device).startswith(("cuda", "mps")):
        from kvsnap.format import prefetch as prefetching

        prefetching.start(prefetch)
    block_store = open_store(opts.store, opts.store_budget)
    startup.stamp("load")
    # Imports torch and transformers too, inside the load's collector-off window (kvsnap_cli.startup).
    lm = ui.load_model(
        opts.model, opts.device, opts.dtype, check_layout=session_config.check_layout, ctx_size=opts.ctx_size
    )
    startup.stamp("loaded")
    from kvsnap.engine.session import Session

    if many_forwards and prefetch is None:
        from kvsnap.models.prepare import reserve_context

        reserve_context(lm)

    if session_config.reuse == "auto" and (reuses or block_store is not None):
        from kvsnap.engine.calibrate import cost_model

        if cost_model(lm, measure=False) is None:
            with ui.status("calibrating load vs recompute (once per machine)") as update:
                cost_model(lm, progress=update)
    return Session(lm, session_config, store=block_store)
