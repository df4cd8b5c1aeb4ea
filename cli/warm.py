"""A warm process: ``kvsnap run`` handed to a process that has already imported torch. Stdlib only.

Why: on a slow 2-core VM ``import torch`` alone takes 1.6-2.7 s of the 3.1-3.7 s from exec to the
first token of ``kvsnap run --resume`` at 4k tokens, for a resume that costs 0.5 s. ``kvsnap warm
start`` leaves a preloader (as Android's zygote or Rails' spring): a process that has imported torch,
the tokenizer library and kvsnap's engine, and does nothing else. ``kvsnap run`` connects to it and
hands over its arguments, working folder, environment, umask and standard streams (the descriptors
themselves); the warm process forks a child that runs the command as a new process would. Nothing
passes from one run to the next: each child is a fresh copy of the preloaded process and loads its
own model. This process forwards signals to the child and exits with its status. Chats and every
other command run here, as before (they read a terminal; a forked child is not in its job control).

Who may use it: only this user. The sockets live in a folder this user owns with mode 0700 (checked
with ``lstat``: never a link), and each side checks the other's uid (``SO_PEERCRED``).

Which runs it takes: those whose ``key`` matches its own. The key covers what a process fixes when
it imports its modules: the interpreter, its flags and search path, the modification time of every
folder on that path (a ``pip install`` changes one) and of kvsnap's own source files, and the
environment variables read at import (``KVSNAP_*``, thread counts, locale, ``HOME``, ...). A run
with another key runs here, as does any run when ``KVSNAP_WARM=0``, or when anything about the
hand-over fails before the child starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import socket
import stat
import struct
import sys
from pathlib import Path

# Environment variables read when torch, tokenizers, numpy, tqdm or kvsnap are imported (thread
# pools, caches, locale): a warm process serves only a run that sets them as it did.
ENV_PREFIXES = (
    "KVSNAP_",
    "OMP_",
    "MKL_",
    "KMP_",
    "GOMP_",
    "OPENBLAS_",
    "TORCH",
    "PYTORCH_",
    "CUDA_",
    "HF_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "TQDM_",
    "PYTHON",
    "LC_",
    "LD_",
)
ENV_NAMES = ("HOME", "LANG", "LANGUAGE", "TMPDIR", "TZ")
COMMANDS = ("run",)  # the commands handed over; see the module's docstring for why not chat
ROOT_OPTIONS = ("--debug",)  # kvsnap's own options, before the command's name
_SOURCES = Path(__file__).resolve().parent.parent  # the folder holding cli/ and kvsnap/
_LENGTH = struct.Struct(">I")
MAX_FRAME = 16 << 20


class WarmError(Exception):
    """The warm process cannot be used or started (a folder not ours, a dead socket, a bad reply)."""


def enabled() -> bool:
    return os.environ.get("KVSNAP_WARM", "1") != "0"


def folder() -> Path:
    """The folder of this user's warm sockets: ``$XDG_RUNTIME_DIR/kvsnap-warm`` or ``/tmp/kvsnap-warm-UID``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime):
        return Path(runtime) / "kvsnap-warm"
    return Path("/tmp") / f"kvsnap-warm-{os.getuid()}"


def checked_folder(create: bool) -> Path:
    """``folder()``, made (0700) if ``create``, and refused unless it is a real folder of this user's
    that no one else can enter."""
    path = folder()
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise WarmError(f"{path}: cannot create the warm folder ({exc.strerror or exc})") from None
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise WarmError(f"{path}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise WarmError(f"{path}: not a folder (a link or a file is never used)")
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise WarmError(f"{path}: owned by uid {st.st_uid} with mode {st.st_mode & 0o777:o}; needs ours, 0700")
    return path


def key() -> str:
    """What a process fixes at import: equal keys, equal preloaded processes (see the docstring)."""
    h = hashlib.sha256()

    def add(*parts: object) -> None:
        h.update(repr(parts).encode("utf-8", "surrogateescape"))

    # The interpreter by what it is (`.venv/bin/python` and `python3` are one), its environment by sys.prefix.
    add(os.path.realpath(sys.executable), sys.prefix, sys.version, tuple(sys.flags), sorted(sys._xoptions.items()))
    add(sys.warnoptions)
    # sys.path[0] is the script's folder or the working folder: a run sends its own (``Request``).
    for entry in sys.path[1:]:
        try:
            st = os.stat(entry)
            add(entry, st.st_ino, st.st_mtime_ns)
        except OSError:
            add(entry, None)
    for name in sorted(os.environ):
        if (name.startswith(ENV_PREFIXES) or name in ENV_NAMES) and name != "KVSNAP_WARM":
            add(name, os.environ[name])
    for package in ("cli", "kvsnap"):
        for dirpath, dirnames, filenames in os.walk(_SOURCES / package):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames):
                if name.endswith(".py"):
                    st = os.stat(os.path.join(dirpath, name))
                    add(os.path.relpath(os.path.join(dirpath, name), _SOURCES), st.st_mtime_ns, st.st_size)
    return h.hexdigest()[:32]


def socket_path(folder_path: Path, warm_key: str) -> Path:
    return folder_path / f"{warm_key}.sock"


def lock(path: Path) -> int | None:
    """An open descriptor holding ``path``'s exclusive lock (made 0600), or None if a live process holds it.

    A server holds its key's lock for life and removes the file, still holding it, as it exits; so a
    file taken here is checked to still be the one at ``path``, else the lock is taken again.
    """
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def unlock(path: Path, fd: int) -> None:
    """Remove ``path`` and release its lock (``fd`` from ``lock``)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.close(fd)


def prune(folder_path: Path) -> None:
    """Remove what dead warm processes left (a socket and lock file whose lock nobody holds)."""
    for stem in {p.stem for p in folder_path.glob("*.sock")} | {p.stem for p in folder_path.glob("*.lock")}:
        sock, lock_path = folder_path / f"{stem}.sock", folder_path / f"{stem}.lock"
        fd = lock(lock_path)
        if fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(sock)
            unlock(lock_path, fd)


def peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def send_frame(sock: socket.socket, obj: object) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(_LENGTH.pack(len(data)) + data)


def recv_frame(sock: socket.socket) -> object:
    """One length-prefixed JSON frame; WarmError on a closed or malformed stream."""
    (size,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))
    if size > MAX_FRAME:
        raise WarmError(f"a frame of {size} bytes")
    try:
        return json.loads(_recv_exact(sock, size))
    except ValueError as exc:
        raise WarmError(f"a malformed frame ({exc})") from None


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    parts, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise WarmError("the connection closed")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def connect(path: Path, timeout: float = 5.0) -> socket.socket:
    """A connection to the warm process at ``path``, checked to run as this user."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise WarmError(f"{path}: not a socket")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError as exc:
        raise WarmError(f"{path}: {exc.strerror or exc}") from None
    try:
        sock.settimeout(timeout)
        sock.connect(str(path))
        if peer_uid(sock) != os.getuid():
            raise WarmError(f"{path}: served by another user")
    except (OSError, WarmError) as exc:
        sock.close()
        raise WarmError(f"{path}: {getattr(exc, 'strerror', None) or exc}") from None
    return sock


def wanted(argv: list[str]) -> bool:
    """Is this command line one a warm process takes (``kvsnap [--debug] run ...``)?"""
    args = list(argv)
    while args and args[0] in ROOT_OPTIONS:
        args.pop(0)
    return bool(args) and args[0] in COMMANDS


def hand_over(argv: list[str]) -> None:
    """Run this command in a warm process if one with this process's key is up, and exit with its status.

    Returns (having done nothing that shows) when there is none, or when anything fails before the
    run has started. The warm process forks the run's child at once, but the child waits for this
    process's go (b"G") before it does anything: a ``kvsnap run`` that gave up waiting (and runs the
    command itself) never has its command run twice. From the go on, this process only forwards
    signals and waits, and never returns.
    """
    if not enabled() or not wanted(argv):
        return
    try:
        path_folder = checked_folder(create=False)  # before the key: most runs have no warm process
        fds = [0, 1, 2]
        for fd in fds:
            os.fstat(fd)  # a closed standard stream: leave such a run to this process
        request = {
            "op": "run",
            "key": key(),
            "argv": [sys.argv[0], *argv],
            "path0": sys.path[0] if sys.path else "",
            "cwd": os.getcwd(),
            "env": dict(os.environ),
            "umask": _umask(),
        }
        sock = connect(socket_path(path_folder, request["key"]))
    except (OSError, WarmError):
        return
    previous = {}
    try:
        socket.send_fds(sock, [b"R"], fds)
        send_frame(sock, request)
        reply = recv_frame(sock)
        pid = reply.get("pid") if isinstance(reply, dict) else None
        if not isinstance(pid, int):  # refused: another key
            raise WarmError(str(reply))
        previous = _forward_signals(pid)  # first: a ^C from the go on reaches the run
        sock.sendall(b"G")
    except (OSError, WarmError):
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        sock.close()  # the child, if any, sees no go and exits without running anything
        return
    sock.settimeout(None)
    try:
        reply = recv_frame(sock)
        status = reply.get("status") if isinstance(reply, dict) else None
    except (OSError, WarmError):
        status = None
    if not isinstance(status, int):
        os.write(2, b"kvsnap: lost the warm process while it ran this command\n")
        os._exit(1)
    _exit_like(status)


def _umask() -> int:
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGWINCH", "SIGCONT")


def _forward_signals(pid: int) -> dict[int, object]:
    """Send the run's child what this process receives; ^Z stops both. Returns the handlers replaced."""

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    def stop(signum: int, _frame: object) -> None:
        # Stop the child, then this process as ^Z would have (the shell sees a stopped job); a SIGCONT
        # (fg, bg) resumes this process, is forwarded, and the child goes on.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        signal.signal(signum, stop)

    previous = {}
    for name in FORWARDED:
        signum = getattr(signal, name)
        previous[signum] = signal.signal(signum, forward)
    previous[signal.SIGTSTP] = signal.signal(signal.SIGTSTP, stop)
    return previous


def _exit_like(status: int) -> None:
    """End this process as the child ended: its exit code, or killed by its signal."""
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)
