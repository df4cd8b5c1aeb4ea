"""The threads that read and decode blocks: one pool per process, and per-read scratch buffers.

zstd and numpy copies release the GIL, so blocks decode in parallel. Starting threads anew is a
cost paid on every restore, so the pool is kept for the process (and made afresh in a forked child,
which inherits none of the parent's threads). No torch here.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

import numpy as np

DECODE_WORKERS = max(1, min(8, os.cpu_count() or 1))

T = TypeVar("T")
R = TypeVar("R")

_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    with _pools_lock:
        pool = _pools.get(workers)
        if pool is None:
            pool = _pools[workers] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvsnap-decode")
        return pool


def shutdown_for_exit() -> None:
    """Stop the process's pools, for a process about to exit: tasks not started are cancelled (a read
    waiting on them fails), running ones finish, and the idle threads end."""
    with _pools_lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        pool.shutdown(wait=True, cancel_futures=True)


def _after_fork_in_child() -> None:
    # A forked child has none of the parent's threads: a pool inherited from it would never run a
    # task, and a lock some parent thread held would never be released.
    global _pools_lock
    _pools.clear()
    _pools_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def map_in_order(fn: Callable[[T], R], items: Iterable[T], workers: int = DECODE_WORKERS) -> list[R]:
    """``[fn(x) for x in items]`` on the process's pool; results in input order.

    On failure nothing is still running when this raises: tasks not started are cancelled and
    running ones waited for, so no worker writes into a caller's buffers afterwards (a failed
    restore is followed by a recompute into other buffers).
    """
    items = list(items)
    if workers <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    futures = [_pool(workers).submit(fn, x) for x in items]
    try:
        return [f.result() for f in futures]
    except BaseException:
        for f in futures:
            f.cancel()
        wait(futures)
        raise


class Scratch:
    """One reusable decode buffer per worker thread for one read (fresh pages for every block would
    cost page faults); dropped with the read, so idle pool threads hold no memory."""

    def __init__(self) -> None:
        self._bufs: dict[int, np.ndarray] = {}

    def get(self, size: int) -> np.ndarray:
        key = threading.get_ident()
        buf = self._bufs.get(key)
        if buf is None or buf.size < size:
            buf = self._bufs[key] = np.empty(size, dtype=np.uint8)
        return buf
