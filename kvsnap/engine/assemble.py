"""One call from settings to a ready ``Session``: ``open_session``. ``kvsnap chat``, ``run``, a batch
and ``serve`` all start here, and so does a library user.

The steps, in the order they run: the settings are checked (before anything slow); a snapshot the
session will resume is read and decoded in a thread while the model loads (``prefetch``); the block
store is opened; the model is resolved (a GGUF converted once) and loaded; what the workload runs
many forwards for is prepared (the KV memory of ``ctx_size``, packed weights, the chat template);
the cost model behind ``reuse="auto"`` is measured later, and only when a decision needs it
(``measure_costs``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kvsnap.config import DEFAULT_DEVICE, DEFAULT_DTYPE, DEFAULT_MODEL, DEFAULT_QUANTIZE, SessionConfig
from kvsnap.errors import ConfigError, StoreError

if TYPE_CHECKING:
    from kvsnap.engine.session import Session
    from kvsnap.models.load import LoadedModel
    from kvsnap.sealing import SealKey
    from kvsnap.store import BlockStore

# once: one prompt and exit; batch: many prompts, no user to wait on; chat: many turns, a user typing
# between them; serve: many requests, from now on.
WORKLOADS = ("once", "batch", "chat", "serve")

Progress = Callable[[str], None]


def open_store(
    path: str | os.PathLike[str] | None,
    budget_bytes: int | None = None,
    *,
    on_problem: Progress | None = None,
    key: SealKey | None = None,
) -> BlockStore | None:
    """The block store in folder ``path`` (created when new or empty; encrypted with ``key``), or None
    without a path. A budget that cannot be written (a full disk) is reported to ``on_problem`` and the
    store still serves what it holds; without ``on_problem`` it raises."""
    if path is None:
        if budget_bytes is not None:
            raise ConfigError("a store budget needs a store folder (--store DIR)")
        return None
    from kvsnap.store import BlockStore

    # A folder that is not a store (a mistyped path) is an error, as it should be.
    store = BlockStore(path, key=key)
    if budget_bytes is not None:
        try:
            store.set_budget(budget_bytes)
        except StoreError as exc:
            if on_problem is None:
                raise
            on_problem(f"warning: store budget not applied ({exc})")
    return store


def open_session(
    model: str = DEFAULT_MODEL,
    config: SessionConfig | None = None,
    *,
    device: str = DEFAULT_DEVICE,
    dtype: str = DEFAULT_DTYPE,
    quantize: str = DEFAULT_QUANTIZE,
    ctx_size: int | None = None,
    store: str | os.PathLike[str] | BlockStore | None = None,
    store_budget: int | None = None,
    workload: str = "once",
    prefetch: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
    measure_costs: Callable[[LoadedModel], object] | bool = False,
    loading: Callable[[], contextlib.AbstractContextManager[object]] | None = None,
) -> Session:
    """A ``Session`` over ``model`` (a name, a local folder or ``.gguf``), ready for its ``workload``.

    ``store``: a block store folder (or an open ``BlockStore``) that every run reads and extends.
    ``prefetch``: a snapshot the session will restore, read and decoded while the model loads (the restore
    takes it only if it is still that file). ``progress`` hears each stage (a conversion, the load).
    ``measure_costs``: how ``reuse="auto"`` gets this machine's cost model when a decision first needs it:
    a callable, True (measure with ``progress``), or False (an unmeasured machine loads). ``loading``: a
    context around the weights' load (the CLI turns Python's cyclic collector off there).

    A chat's background preparation (``kvsnap.engine.prepare.preload``) is left to its caller, to start
    once the conversation is restored: it would compete with the restore for the same cores.
    """
    from kvsnap.engine import calibrate, prepare
    from kvsnap.engine.session import Session
    from kvsnap.models import load_model, resolve_model

    if workload not in WORKLOADS:
        raise ConfigError(f"workload must be one of {', '.join(WORKLOADS)}, not {workload!r}")
    say = progress or (lambda _msg: None)
    config = (config or SessionConfig()).check(with_store=store is not None)
    if prefetch is not None and not str(device).startswith(("cuda", "mps")) and Path(prefetch).exists():
        from kvsnap.format import prefetch as prefetching

        prefetching.start(prefetch)
    if store is None or hasattr(store, "lookup"):
        block_store = store
    else:
        block_store = open_store(store, store_budget, on_problem=say, key=config.key)
    # A first use converts a GGUF model here, outside ``loading``: the dequantized copy it drops must be freed.
    resolve_model(model, progress=say, install=True)
    with loading() if loading is not None else contextlib.nullcontext():
        lm = load_model(
            model,
            device=device,
            dtype=dtype,
            quantize=quantize,
            progress=say,
            install=True,
            check_layout=config.check_layout,
            ctx_size=ctx_size,
        )
    if workload in ("batch", "chat", "serve") and prefetch is None:
        prepare.reserve_context(lm)  # a prefetch holds that memory already
    if workload == "batch":
        prepare.start_packing(lm)
    elif workload == "serve":
        prepare.preload(lm)
    if measure_costs is True:

        def measure_costs(lm: LoadedModel) -> object:
            return calibrate.calibrate(lm, progress=say)

    return Session(lm, config, store=block_store, measure_costs=measure_costs or None)
