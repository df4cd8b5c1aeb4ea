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


def default_store() -> Path:
    """The block store a command uses when none is named: ``$KVSNAP_STORE``, else ``$KVSNAP_HOME/store``."""
    from kvsnap.models.catalog import kvsnap_home

    return Path(os.environ.get("KVSNAP_STORE") or kvsnap_home() / "store")


def open_store(path, budget: str | None, key=None):
    """The block store behind --store/--store-budget (encrypted with ``key``, --encrypt), or None; a
    budget that cannot be written is a warning."""
    from kvsnap.engine.assemble import open_store as open_block_store
    from kvsnap_cli.sizes import parse_size

    budget_bytes = parse_size(budget) if budget is not None else None
    if path is None and budget_bytes is not None:
        from kvsnap.errors import ConfigError

        raise ConfigError("--store-budget needs --store DIR")
    return open_block_store(path, budget_bytes, on_problem=ui.note, key=key)


def measure_costs(lm) -> None:
    """Measure this machine's load-or-recompute costs for ``lm``, with progress: once, when ``--reuse auto``
    first has a stored prefix to decide on. Says so once if the result cannot be kept on disk."""
    from kvsnap.engine import calibrate, costs

    with ui.status("measuring load vs recompute for this model and dtype (once)") as update:
        calibrate.calibrate(lm, progress=update)
    if not costs.kept_on_disk(lm):
        ui.note(f"could not keep the measurement in {costs.cache_path(lm).parent}: it is used by this process only")


def open_session(
    opts: SessionOptions,
    session_config: SessionConfig | None = None,
    *,
    workload: str = "once",
    prefetch: Path | None = None,
    store: Any = "from options",
):
    """The Session ``chat``, ``run`` and ``serve`` work with (``kvsnap.open_session``): settings checked,
    the block store opened, the model loaded with a spinner, the cost model measured when first needed."""
    from kvsnap.engine.assemble import open_session as assemble

    session_config = session_config or opts.session_config()
    block_store = open_store(opts.store, opts.store_budget, session_config.key) if store == "from options" else store
    startup.stamp("load")
    with ui.status(f"loading {opts.model}") as update:
        session = assemble(
            opts.model,
            session_config,
            device=opts.device,
            dtype=opts.dtype,
            quantize=opts.quantize,
            ctx_size=opts.ctx_size,
            store=block_store,
            workload=workload,
            prefetch=prefetch,
            progress=update,
            measure_costs=measure_costs,
            loading=startup.collector_off,
        )
    startup.stamp("loaded")
    return session
