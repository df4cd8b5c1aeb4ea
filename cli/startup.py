"""What a new ``kvsnap`` process spends before its first token, and after its last.

Importing torch and transformers and loading a model make ~400k Python objects that live as long
as the process. Python's cyclic garbage collector walks them again and again while they are made
(a sizeable share of the time to a loaded model) and once more at exit (most of the exit's time;
docs/benchmarks.md has the figures).
So a process the CLI owns (``kvsnap_cli.main.main``, not a test's in-process runner) loads its model with
the collector off, then freezes what exists (``gc.freeze``: kept out of later collections, never
walked again), and freezes again at exit. What stays frozen that was garbage is bounded: the cycles
the imports and a load leave (small objects, no tensors). A GGUF
conversion runs before this, with the collector on: the dequantized model it drops must be freed.

``KVSNAP_TIMINGS=1`` adds wall-clock stamps of each stage to ``kvsnap run --json`` (``timings``),
for benchmarks/startup.py.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
import threading
import time
from collections.abc import Iterator

TIMINGS = os.environ.get("KVSNAP_TIMINGS") == "1"
stamps: dict[str, float] = {}  # stage -> time.time() when it was reached (first time only)
own_process = False  # set by kvsnap_cli.main.main: this interpreter runs the CLI and nothing else


def stamp(stage: str) -> None:
    if TIMINGS:
        stamps.setdefault(stage, time.time())


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """Run a model load without the cyclic collector; on success, freeze what it made."""
    if not own_process or not gc.isenabled():
        yield
        return
    gc.disable()
    loaded = False
    try:
        yield
        loaded = True
    finally:
        if loaded:
            gc.freeze()
        gc.enable()


def exiting() -> None:
    """The interpreter is about to exit: spare it a last collection over everything (the OS frees it)."""
    if own_process:
        gc.freeze()


def leave(code: object) -> None:
    """End a finished CLI process now, skipping the interpreter's teardown, or return if that is not safe.

    Tearing down the modules torch and the model made is most of the time from the last output to
    the exit, and the OS frees all of it anyway. Skipped only once the command is
    over: no thread of ours is still working (a non-daemon thread the interpreter would join, a
    background save say), the exit code is a plain number, and the output flushed (a stream that
    cannot be flushed, or is closed, leaves the exit to the interpreter, which reports it its own
    way). The ``atexit`` handlers still run (temporary folders, logging), as in a normal exit.
    """
    if not own_process or not (code is None or isinstance(code, int)):
        return
    pool = sys.modules.get("kvsnap.format.pool")
    if pool is not None:
        pool.shutdown_for_exit()  # idle decode workers: the interpreter would join them too
    main = threading.main_thread()
    if any(t is not main and not t.daemon and t.is_alive() for t in threading.enumerate()):
        return
    if not _flushed():
        return
    atexit._run_exitfuncs()
    _flushed()
    with contextlib.suppress(Exception):  # C stdio (a library's own printf), which os._exit does not flush
        import ctypes

        ctypes.CDLL(None).fflush(None)
    os._exit(code or 0)


def _flushed() -> bool:
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:  # None: the descriptor was closed when Python started (`>&-`)
                stream.flush()
    except Exception:  # noqa: BLE001  (a closed pipe, a closed or replaced stream: any failure returns False)
        return False
    return True
