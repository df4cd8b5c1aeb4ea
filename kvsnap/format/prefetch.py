"""Reading and decoding a ``.kv`` file in a background thread while the model loads. No torch here.

A new process that resumes (``kvsnap run --resume``, ``kvsnap chat --resume``) spends seconds
importing and loading the model, and the restore waits for it although it needs nothing of the
model: the snapshot states its own cache layout. So the CLI calls ``start(path)`` first; a thread
opens the file, checks it, allocates the KV buffer (its page faults are paid here too) and decodes
every block into it, while the main thread imports torch and loads weights (zstd, numpy copies
and page faults run outside the GIL). The restore then ``claim``s the work if it is for the very
file it opens; whether the snapshot fits the model, the prompt and the session is decided there,
exactly as without a prefetch. Any problem in the thread is not reported from here: the restore
reads the file the ordinary way and reports it as it always does.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvsnap.format.reader import Snapshot

# Tokens of room after the snapshot's own, so a resumed prompt and its first answer are written
# in place (more is grown by the cache as usual).
ROOM = 1024


@dataclass
class Prefetched:
    """Every block of ``snapshot`` decoded into ``kv`` (uint8 ``[L, 2, kv_heads, capacity, head_dim * itemsize]``)."""

    snapshot: Snapshot
    kv: np.ndarray
    stored: list[memoryview]
    identity: tuple[int, int, int, int]


class _Job:
    def __init__(self, path: Path):
        self.path = path
        self.result: Prefetched | None = None
        self.thread = threading.Thread(target=self._run, name="kvsnap-prefetch", daemon=True)

    def _run(self) -> None:
        snap = None
        try:
            snap = Snapshot(self.path)
            self.result = _decode_all(snap)
        except Exception:  # the restore reads the file again and reports what is wrong
            self.result = None
        finally:
            if self.result is None and snap is not None:
                snap.close()


_jobs: dict[Path, _Job] = {}
_lock = threading.Lock()


def _key(path: str | os.PathLike[str]) -> Path:
    try:
        return Path(os.path.abspath(path))
    except FileNotFoundError:  # the working folder was deleted: the path as given is all there is
        return Path(path)


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _budget() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    except (ValueError, OSError, AttributeError):
        return 1 << 30


def _decode_all(snap: Snapshot) -> Prefetched | None:
    meta = snap.meta
    layout = meta.layout
    if meta.storage_layout != layout or not meta.blocks:
        return None  # narrower stored blocks are cast as they are copied: the ordinary path does that
    L, H, D, size = layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.itemsize
    capacity = len(meta.blocks) * meta.block_size + ROOM
    if L * 2 * H * capacity * D * size > _budget():
        return None
    kv = np.empty((L, 2, H, capacity, D * size), dtype=np.uint8)
    grid = kv.reshape(L, 2, H, capacity, D, size)
    starts = [i * meta.block_size for i in range(len(meta.blocks))]

    def target(index: int) -> np.ndarray:
        return grid[:, :, :, starts[index] : starts[index] + meta.blocks[index].num_tokens]

    def sink(index: int, raw: np.ndarray) -> None:  # never called: every block has a target
        raise AssertionError(index)

    stored = snap.read_into(range(len(meta.blocks)), sink, target=target)
    return Prefetched(snap, kv, stored, snap.identity)


def start(path: str | os.PathLike[str]) -> None:
    """Begin reading and decoding the snapshot at ``path`` in a background thread (once per path)."""
    key = _key(path)
    with _lock:
        if key in _jobs:
            return
        job = _jobs[key] = _Job(key)
    job.thread.start()


def claim(path: str | os.PathLike[str]) -> Prefetched | None:
    """The decoded snapshot at ``path``, if a prefetch of it was started and it is still the same
    file (waits for the thread); None otherwise. A prefetch is claimed at most once."""
    with _lock:
        job = _jobs.pop(_key(path), None)
    if job is None:
        return None
    job.thread.join()
    result = job.result
    if result is None:
        return None
    try:
        now = _identity(os.stat(path))
    except OSError:
        now = None
    if now != result.identity:
        result.snapshot.close()  # saved over since: the restore reads what is there now
        return None
    return result


def discard() -> None:
    """Drop every prefetch not claimed (waiting for its thread), closing its file."""
    with _lock:
        jobs = list(_jobs.values())
        _jobs.clear()
    for job in jobs:
        job.thread.join()
        if job.result is not None:
            job.result.snapshot.close()
