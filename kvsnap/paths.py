"""Files a user names: read only regular files, read them bounded, and check a save target first.

A FIFO with no writer hangs a read forever, ``/dev/zero`` never ends one, and a save over a
symlink or a device would write through it or replace it. Each is refused up front with one
line; the caller picks the ``KvsnapError`` type (``SnapshotError`` for a ``.kv``, ``ConfigError``
for a prompt file, ``SaveError`` for a save). Following a symlink to *read* is fine: what is
checked is the file it names. What kvsnap runs or maps from its own folders (a built kernel, a kept
quantized model) must be private: ``private_folder`` and ``private_file`` say so. No torch here.
"""

from __future__ import annotations

import contextlib
import os
import stat
from typing import Any, BinaryIO

from kvsnap.errors import KvsnapError

# O_NONBLOCK: a FIFO swapped in between the check and the open must not block the open itself.
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


def kind_of(mode: int) -> str:
    """What a non-regular file is, in words ("a FIFO", "a directory", ...)."""
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | os.PathLike[str], *, error: type[KvsnapError], what: str = "file") -> BinaryIO:
    """Open ``path`` for binary reading if it is a regular file (a symlink to one is fine).

    Anything else, a missing file or an unreadable one raises ``error`` with one line naming
    ``what`` ("snapshot", "prompt file", ...). The file object returned is the file checked.
    """
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path}: {what} is {kind_of(st.st_mode)}, not a regular file")
        fd = os.open(path, _READ_FLAGS)
    except FileNotFoundError:
        raise error(f"{path}: no such {what}") from None
    except OSError as exc:
        raise error(f"{path}: cannot read {what} ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # replaced between the stat and the open
            raise error(f"{path}: {what} is {kind_of(st.st_mode)}, not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: str | os.PathLike[str], limit: int, *, error: type[KvsnapError], what: str = "file") -> bytes:
    """The bytes of regular file ``path``, refused with ``error`` past ``limit`` bytes.

    The read itself is bounded (``limit + 1`` bytes at most), not only the size ``stat`` reports:
    a file can grow while it is read.
    """
    with open_regular(path, error=error, what=what) as f:
        try:
            data = f.read(limit + 1)
        except OSError as exc:
            raise error(f"{path}: cannot read {what} ({exc.strerror or exc})") from None
    if len(data) > limit:
        raise error(f"{path}: {what} larger than {_size(limit)}")
    return data


def json_object(path: str | os.PathLike[str], limit: int = 16 << 20) -> dict[str, Any] | None:
    """A small JSON object file, or None when it is missing, not a regular file, too large, nested
    past the parser's depth or not a JSON object: for files kvsnap reads only if they are sound (a
    model folder's side files, its own caches), whose absence the caller handles."""
    import json

    try:
        raw = json.loads(read_bounded(path, limit, error=KvsnapError))
    except (KvsnapError, ValueError, RecursionError):
        return None
    return raw if isinstance(raw, dict) else None


def check_save_target(path: str | os.PathLike[str], *, error: type[KvsnapError]) -> None:
    """Refuse a save target that could not be replaced safely, with ``error`` and one line.

    A missing file is fine if its folder exists; an existing one must be a regular file. A
    symlink is refused rather than followed or replaced: writing through it would overwrite a file
    the user did not name. Only the last part of the path is checked (a folder reached through a
    link is fine).
    """
    try:
        folder = os.path.dirname(os.path.abspath(path))
    except FileNotFoundError:  # abspath asks for the working folder, which was deleted
        raise error(f"{path}: cannot save there, the working folder no longer exists") from None
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not os.path.isdir(folder):
            raise error(f"{path}: cannot save there, folder {folder} does not exist") from None
        return
    except OSError as exc:
        raise error(f"{path}: cannot save there ({exc.strerror or exc})") from None
    if stat.S_ISLNK(st.st_mode):
        raise error(f"{path}: is a symbolic link; kvsnap does not save through links (name the file itself)")
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path}: is {kind_of(st.st_mode)}, not a regular file; refusing to replace it")


def private_folder(path: str | os.PathLike[str], *, make: bool = True) -> bool:
    """``path`` is a real folder of this user's that no one else may write (made so, if ``make`` and missing):
    where kvsnap keeps what it runs or maps (a built kernel, a quantized model), nobody else may plant a file."""
    if make:
        with contextlib.suppress(FileExistsError):
            os.makedirs(path, mode=0o700)
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and _only_ours(info)


def private_file(path: str | os.PathLike[str]) -> bool:
    """``path`` (not followed if a link) is a regular file of this user's that no one else may write."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and _only_ours(info)


def _only_ours(info: os.stat_result) -> bool:
    return info.st_uid == os.getuid() and not info.st_mode & 0o022


def _size(n: int) -> str:
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20} MiB"
    return f"{n:,} bytes"
