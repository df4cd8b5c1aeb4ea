"""Whole-or-nothing file writes: a temp file in the same folder, fsync, rename, folder fsync.

Used for ``.kv`` snapshots and the block store. Writers into one folder take turns under an
advisory ``fcntl`` lock on the folder; a temp file a killed writer left is removed by the next
write of the same target.

A snapshot holds the conversation in plain text, so it is created 0600 (like shell history); a
file it replaces keeps its mode only as far as that is no wider. The path is used as given: a
symlink or a special file (FIFO, device, ...) at the target is refused, never written through or
replaced.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from kvsnap.errors import SaveError
from kvsnap.paths import check_save_target

# How long a save waits for another writer's folder lock before going on without it (a writer that
# hangs, or anyone else holding a lock on a shared folder such as /tmp, must not hang every save).
LOCK_WAIT_S = 10.0


def atomic_write(path: Path, parts: list[bytes | memoryview]) -> int:
    path = Path(path)
    folder = path.parent
    try:
        if not folder.is_dir():
            raise SaveError(f"{path}: cannot save there, folder {folder} does not exist")
        # Writers into one folder take turns; locking the folder leaves no sidecar file behind.
        with locked(folder, best_effort=True, timeout=LOCK_WAIT_S) as held:
            check_save_target(path, error=SaveError)
            if held:
                # Under the lock no other writer is active: any temp file of this target is a crash's leftover.
                remove_stale_temps(path)
            try:
                mode = os.lstat(path).st_mode & 0o600
            except FileNotFoundError:
                mode = 0o600
            size = replace_whole(path, parts, mode)
            fsync_dir(folder)
    except SaveError:
        raise
    except OSError as exc:
        err = SaveError(f"{path}: cannot save ({exc.strerror or exc}); the previous file is unchanged")
        err.errno = exc.errno
        raise err from None
    return size


def replace_whole(path: Path, parts: list[bytes | memoryview], mode: int | None = None) -> int:
    """Write ``parts`` to a temp file beside ``path``, fsync it and rename it over ``path``.

    The bare step, with no lock: on any error (``OSError`` or an interrupt) the temp file is
    removed and ``path`` is untouched. ``mode`` defaults to mkstemp's 0600. Returns the size.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if mode is not None:
            os.fchmod(fd, mode)  # mkstemp makes 0600; keep the permissions a plain write would give
        with os.fdopen(fd, "wb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return size


def fsync_dir(folder: Path) -> None:
    # The rename is durable only once the folder's entry is on disk.
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


@contextlib.contextmanager
def locked(
    path: Path, *, exclusive: bool = True, best_effort: bool = False, timeout: float | None = None
) -> Iterator[bool]:
    """An advisory ``fcntl`` lock on ``path``: a folder, or a lock file (created if missing).

    Exclusive for writers, shared for readers; yields whether the lock is held. With ``best_effort``
    a path that cannot be opened or locked within ``timeout`` seconds is not locked (atomic renames
    still keep every file whole); otherwise the ``OSError`` is raised. A lock file that is a symlink
    or not a regular file is never opened through (a FIFO would block the open). Without fcntl
    (Windows) nothing is locked.
    """
    try:
        import fcntl
    except ImportError:
        yield False
        return
    try:
        fd = _open_lock(path)
    except OSError:
        if not best_effort:
            raise
        yield False
        return
    try:
        op = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        if timeout is None:
            fcntl.flock(fd, op)
        else:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(fd, op | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        if not best_effort:
                            raise
                        yield False
                        return
                    time.sleep(0.05)
        yield True
    finally:
        os.close(fd)  # closing releases the lock


def _open_lock(path: Path) -> int:
    flags = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if os.path.isdir(path):
        return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | flags, 0o644)
    except OSError:  # a read-only folder or file: a shared lock still works on a read-only open
        fd = os.open(path, os.O_RDONLY | flags)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{path}: lock file is not a regular file")
    return fd


def remove_stale_temps(path: Path) -> list[Path]:
    """Delete temp files a crashed save of ``path`` left behind; returns what was removed."""
    folder = path.parent if str(path.parent) else Path(".")
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.[A-Za-z0-9_]{{8}}\.tmp$")
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            if pattern.match(entry.name):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                    removed.append(Path(entry.path))
    return removed
