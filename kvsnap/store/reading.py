"""Reading a file inside a block store: never through a link, never blocking, never more than expected.

A FIFO at a block's name would hang a reader forever (holding the store's lock), a link to
``/dev/zero`` or a block file grown to gigabytes would be read whole before its size was checked.
So every read here opens a regular file only (``lstat`` first, then ``O_NOFOLLOW | O_NONBLOCK``,
then ``fstat`` of what was opened), checks its size before reading, and reads at most what the
caller expects. No torch here.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from kvsnap.errors import StoreError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


def open_regular(root: Path, rel: Sequence[str], what: str) -> tuple[int, int]:
    """Open ``root/rel`` for reading: a regular file reached without following a link below ``root``,
    opened without blocking. Returns the descriptor and the file's size; ``FileNotFoundError`` if it is
    not there, ``StoreError`` for a link, a folder, a FIFO or any other special file."""
    path = root.joinpath(*rel)
    try:
        if os.open not in os.supports_dir_fd or not _NOFOLLOW:
            return _open_plain(path, what)
        dir_fd = os.open(root, os.O_RDONLY | _DIRECTORY)
        try:
            for part in rel[:-1]:
                try:
                    inner = os.open(part, os.O_RDONLY | _DIRECTORY | _NOFOLLOW, dir_fd=dir_fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise StoreError(f"{path}: a folder on the way is a link or a file; not followed") from None
                    raise
                os.close(dir_fd)
                dir_fd = inner
            st = os.stat(rel[-1], dir_fd=dir_fd, follow_symlinks=False)
            _regular(path, st, what)
            fd = os.open(rel[-1], os.O_RDONLY | _NOFOLLOW | _NONBLOCK, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise StoreError(f"{path}: cannot read {what} ({exc.strerror or exc})") from None
    return _checked(fd, st, path, what)


def _open_plain(path: Path, what: str) -> tuple[int, int]:
    st = os.lstat(path)
    _regular(path, st, what)
    return _checked(os.open(path, os.O_RDONLY | _NONBLOCK), st, path, what)


def _regular(path: Path, st: os.stat_result, what: str) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise StoreError(f"{path}: {what} is a link; links inside the store are not followed")
    if not stat.S_ISREG(st.st_mode):
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise StoreError(f"{path}: {what} is {kind}; not read")


def _checked(fd: int, st: os.stat_result, path: Path, what: str) -> tuple[int, int]:
    now = os.fstat(fd)
    if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise StoreError(f"{path}: {what} changed while it was opened")
    return fd, now.st_size


def read_at(fd: int, n: int, offset: int) -> bytes:
    """Up to ``n`` bytes from ``offset`` (fewer only at the end of the file)."""
    parts, got = [], 0
    while got < n:
        chunk = os.pread(fd, min(n - got, 1 << 30), offset + got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def read_regular(root: Path, rel: Sequence[str], what: str, limit: int) -> bytes:
    """A whole small file, refused unread when larger than ``limit`` bytes."""
    path = root.joinpath(*rel)
    fd, size = open_regular(root, rel, what)
    try:
        if size > limit:
            raise StoreError(
                f"{path}: {what} is {size:,} bytes, more than the {limit:,} it may be (damaged?); not read"
            )
        data = read_at(fd, size + 1, 0)  # one byte more: a file growing meanwhile is caught
    except OSError as exc:
        raise StoreError(f"{path}: cannot read {what} ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    if len(data) != size:
        raise StoreError(f"{path}: {what} changed while it was read; not used")
    return data


def listdir(path: str | Path) -> list[os.DirEntry]:
    """A folder's entries by name (none when it cannot be read)."""
    try:
        with os.scandir(path) as it:
            return sorted(it, key=lambda e: e.name)
    except OSError:
        return []
