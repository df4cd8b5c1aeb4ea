"""Whole-or-nothing file writes: a temp file in the same folder, fsync, rename, folder fsync.

Used for ``.kv`` snapshots and the block store. Writers into one folder take turns under an
advisory ``fcntl`` lock on the folder; a temp file a killed writer left is removed by the next
write of the same target.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kvsnap.errors import SaveError


def atomic_write(path: Path, parts: list[bytes | memoryview]) -> int:
    # Write through a symlink to the file it names, as an in-place writer would.
    path = Path(os.path.realpath(path))
    folder = path.parent
    try:
        # Writers into one folder take turns; locking the folder leaves no sidecar file behind.
        with locked(folder, best_effort=True):
            # Under the lock no other writer is active: any temp file of this target is a crash's leftover.
            remove_stale_temps(path)
            try:
                mode = os.stat(path).st_mode & 0o777
            except OSError:
                umask = os.umask(0)
                os.umask(umask)
                mode = 0o666 & ~umask
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
def locked(path: Path, *, exclusive: bool = True, best_effort: bool = False) -> Iterator[None]:
    """An advisory ``fcntl`` lock on ``path``: a folder, or a lock file (created if missing).

    Exclusive for writers, shared for readers. With ``best_effort`` a path that cannot be opened
    is not locked (atomic renames still keep every file whole); otherwise its ``OSError`` is raised.
    Without fcntl (Windows) nothing is locked.
    """
    try:
        import fcntl
    except ImportError:
        yield
        return
    try:
        if os.path.isdir(path):
            fd = os.open(path, os.O_RDONLY)
        else:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError:
                fd = os.open(path, os.O_RDONLY)
    except OSError:
        if not best_effort:
            raise
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # closing releases the lock


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
