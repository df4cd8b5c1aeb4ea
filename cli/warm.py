"""A warm process: ``kvsnap run`` handed to a process that has already imported torch. Stdlib only.

Why: on a slow 2-core VM ``import torch`` alone takes 1.9-2.5 s of the 3.2-4.0 s from exec to the
first token of ``kvsnap run --resume`` at 4k tokens, for a resume that costs 0.5 s. ``kvsnap warm
start`` leaves a preloader (as Android's zygote or Rails' spring): a process that has imported torch,
the tokenizer library and kvsnap's engine, and does nothing else (cli.warm_server). ``kvsnap run``
(cli.warm_client) connects to it and hands over its arguments, environment, umask, signal
dispositions and mask, and its working folder and standard streams (the descriptors themselves);
the warm process forks a child that becomes the run (cli.warm_child) and runs the command as a new
process would. Nothing passes from one run to the next: each child is a fresh copy of the
preloaded process and loads its own model. Chats and every other command run in their own process
(a chat owns its terminal; a forked child is not in its job control).

Who may use it: only this user, from the same context. The sockets live in a folder this user
owns with mode 0700 (checked with ``lstat``: never a link); each side checks the other's uid
(``SO_PEERCRED``), and the warm process serves only a process whose namespaces, cgroup, groups,
CPU set, limits, niceness, capabilities and seccomp state are its own (``context``): a sandboxed
process of the same user gets nothing out of its sandbox, and no run escapes the limits it was
started under.

Which runs it takes: those whose ``key`` matches its own. The key covers what a process fixes when
it imports its modules: the interpreter, its flags and search path, the modification time of every
folder on that path (a ``pip install`` changes one) and of kvsnap's own source files, and the
environment variables read at import (``KVSNAP_*``, thread counts, allocator and CPU-feature
settings, locale, ``HOME``, ...). Any other run runs in its own process, as does any run when
``KVSNAP_WARM=0``, on a system without what this needs (Linux: ``SO_PEERCRED``, pidfds, /proc), or
when anything about the hand-over fails before the run starts.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import stat
import struct
import sys
from pathlib import Path

# Environment variables read when torch, tokenizers, numpy, tqdm, glibc or kvsnap start: a warm
# process serves only a run that sets them as it did.
ENV_PREFIXES = (
    "KVSNAP_",
    "OMP_",
    "MKL_",
    "KMP_",
    "GOMP_",
    "OPENBLAS_",
    "NPY_",
    "NUMPY_",
    "TORCH",
    "PYTORCH_",
    "ATEN_",
    "CUDA_",
    "HF_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "TQDM_",
    "PYTHON",
    "LC_",
    "LD_",
    "MALLOC_",
)
ENV_NAMES = ("HOME", "LANG", "LANGUAGE", "TMPDIR", "TZ", "GLIBC_TUNABLES")
COMMANDS = ("run",)  # the commands handed over; see the module's docstring for why not chat
ROOT_OPTIONS = ("--debug",)  # kvsnap's own options, before the command's name
_SOURCES = Path(__file__).resolve().parent.parent  # the folder holding cli/ and kvsnap/
_LENGTH = struct.Struct(">I")
MAX_FRAME = 16 << 20


class WarmError(Exception):
    """The warm process cannot be used or started (a dead socket, a refusal, a bad reply)."""


class WarmFolderError(WarmError):
    """The folder of the sockets is not this user's alone: never used."""


def supported() -> bool:
    return sys.platform == "linux" and hasattr(socket, "SO_PEERCRED") and hasattr(os, "pidfd_open")


def enabled() -> bool:
    return supported() and os.environ.get("KVSNAP_WARM", "1") != "0"


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
        raise WarmFolderError(f"{path}: not a folder (a link or a file is never used)")
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise WarmFolderError(f"{path}: owned by uid {st.st_uid} with mode {st.st_mode & 0o777:o}; needs ours, 0700")
    return path


def key() -> str:
    """What a process fixes at import: equal keys, equal preloaded processes (see the docstring)."""
    h = hashlib.sha256()

    def add(*parts: object) -> None:
        h.update(repr(parts).encode("utf-8", "surrogateescape"))

    # The interpreter by what it is (`.venv/bin/python` and `python3` are one), its environment by sys.prefix.
    add(os.path.realpath(sys.executable), sys.prefix, sys.version, tuple(sys.flags), sorted(sys._xoptions.items()))
    add(sys.warnoptions, str(_SOURCES))
    # sys.path[0] is the script's folder or the working folder: a run sends its own (``Request``).
    for entry in sys.path[1:]:
        try:
            st = os.stat(entry)
            add(entry, st.st_dev, st.st_ino, st.st_mtime_ns)
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


_STATUS_FIELDS = ("Gid:", "Groups:", "NoNewPrivs:", "Seccomp:", "CapInh:", "CapPrm:", "CapEff:", "CapBnd:", "CapAmb:")
_STATUS_FIELDS += ("Cpus_allowed_list:", "Mems_allowed_list:")


def context(pid: int) -> tuple:
    """Process ``pid``'s sandbox and limits, as /proc shows them: namespaces, cgroup, groups,
    capabilities, seccomp, CPU and memory-node sets, resource limits and niceness. OSError if any
    of it cannot be read (a process of ours made non-dumpable, say: then it is not served)."""
    proc = f"/proc/{pid}"
    spaces = tuple(os.readlink(f"{proc}/ns/{ns}") for ns in ("mnt", "pid", "user", "net", "ipc", "uts", "cgroup"))
    with open(f"{proc}/status") as f:
        status = tuple(line.strip() for line in f if line.startswith(_STATUS_FIELDS))
    with open(f"{proc}/cgroup") as f:
        cgroup = f.read()
    with open(f"{proc}/limits") as f:
        limits = f.read()
    with open(f"{proc}/stat") as f:
        nice = f.read().rsplit(")", 1)[1].split()[16]  # field 19, after the command's name
    return spaces, status, cgroup, limits, nice


def socket_path(folder_path: Path, warm_key: str) -> Path:
    return folder_path / f"{warm_key}.sock"


def lock(path: Path) -> int | None:
    """An open descriptor holding ``path``'s exclusive lock (made 0600), or None if a live process holds it.

    A server holds its key's lock for life and removes the file, still holding it, as it exits; so a
    file taken here is checked to still be the one at ``path``, else the lock is taken again.
    """
    import fcntl

    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise WarmError(f"{path}: not a regular file")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        try:
            now = os.stat(path, follow_symlinks=False)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
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
        try:
            fd = lock(lock_path)
        except (OSError, WarmError):
            continue
        if fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(sock)
            unlock(lock_path, fd)


def peer(sock: socket.socket) -> tuple[int, int]:
    """The (pid, uid) of the process at the other end of ``sock``."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


def send_frame(sock: socket.socket, obj: object, fds: list[int] = ()) -> None:
    """One length-prefixed JSON frame, with ``fds`` (SCM_RIGHTS) on its first byte."""
    data = json.dumps(obj).encode()
    data = _LENGTH.pack(len(data)) + data
    if fds:
        sent = socket.send_fds(sock, [data], list(fds))
        data = data[sent:]
    sock.sendall(data)


def recv_frame(sock: socket.socket, max_fds: int = 0) -> tuple[object, list[int]]:
    """One length-prefixed JSON frame and the descriptors that came with it; WarmError on a closed or
    malformed stream (descriptors received are closed then)."""
    fds: list[int] = []
    try:
        head = b""
        if max_fds:
            head, fds, _flags, _addr = socket.recv_fds(sock, _LENGTH.size, max_fds)
            if not head:
                raise WarmError("the connection closed")
        head += _recv_exact(sock, _LENGTH.size - len(head))
        (size,) = _LENGTH.unpack(head)
        if size > MAX_FRAME:
            raise WarmError(f"a frame of {size} bytes")
        try:
            return json.loads(_recv_exact(sock, size)), fds
        except ValueError as exc:
            raise WarmError(f"a malformed frame ({exc})") from None
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


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
        if peer(sock)[1] != os.getuid():
            raise WarmError(f"{path}: served by another user")
    except (OSError, WarmError) as exc:
        sock.close()
        raise WarmError(f"{path}: {getattr(exc, 'strerror', None) or exc}") from None
    return sock


def ask(path: Path, op: str) -> dict:
    """A warm process's answer to ``op`` ("status", "stop")."""
    sock = connect(path)
    try:
        send_frame(sock, {"op": op})
        reply, _ = recv_frame(sock)
    except OSError as exc:
        raise WarmError(str(exc)) from None
    finally:
        sock.close()
    if not isinstance(reply, dict):
        raise WarmError("a malformed reply")
    return reply


def wanted(argv: list[str]) -> bool:
    """Is this command line one a warm process takes (``kvsnap [--debug] run ...``)?"""
    args = list(argv)
    while args and args[0] in ROOT_OPTIONS:
        args.pop(0)
    return bool(args) and args[0] in COMMANDS
