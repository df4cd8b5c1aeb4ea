"""The warm process itself (see ``cli.warm``): preload, then fork a child per ``kvsnap run`` handed over.

It is started by ``kvsnap warm start`` as ``python -c 'from cli.warm_server import main; main()'``
in a new session (no terminal), reports ``ready`` on its standard output, and from then on writes
nothing. One thread, one ``select`` loop: new connections; each child's exit (a pidfd), which is
sent back to its ``kvsnap run`` as a wait status; and each connection's close, which means that
``kvsnap run`` is gone, so its child is sent SIGTERM, as a terminal's hangup would end it.

It imports no ``cli`` module but this one and ``cli.warm`` (``cli.ui`` makes its rich consoles at
import, from the standard streams of the process), and no typer or rich (they read the terminal's
environment at import). Everything it imports runs no thread: a fork copies only the thread that
calls it, so one started before would be missing, its locks held, in every child (checked before
serving). It holds a lock on ``KEY.lock`` as long as it lives: a second ``warm start`` of the same key
sees it and leaves, and a socket whose lock is free is a dead one's, which is removed.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import selectors
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from cli import warm

# What `kvsnap run --resume` imports beyond the CLI (python -X importtime); numpy first (``_preload``).
PRELOAD = (
    "numpy",
    "zstandard",
    "xxhash",
    "safetensors",
    "tokenizers",
    "torch",
    "torch.nn.functional",
    "kvsnap.config",
    "kvsnap.paths",
    "kvsnap.format.reader",
    "kvsnap.format.writer",
    "kvsnap.format.prefetch",
    "kvsnap.reuse",
    "kvsnap.models.resolve",
    "kvsnap.models.load",
    "kvsnap.models.native",
    "kvsnap.models.plain_tokenizer",
    "kvsnap.models.prepare",
    "kvsnap.engine.session",
    "kvsnap.engine.runner",
    "kvsnap.engine.calibrate",
)
ACCEPT_TIMEOUT = 5.0  # seconds a connection may take to send its request


class _Child(Exception):
    """Raised in a forked child to leave the server's loop and run its command (once ``go`` says so)."""

    def __init__(self, request: dict, fds: list[int], go: int):
        self.request, self.fds, self.go = request, fds, go


@dataclass
class _Run:
    """A run's child, as the server sees it: its ``kvsnap run``'s connection, its pidfd, and the pipe
    that passes on that connection's go (None once passed on, or refused)."""

    conn: socket.socket
    pidfd: int
    go: int | None


def main() -> None:
    idle = float(sys.argv[1]) if len(sys.argv) > 1 else 900.0
    models = sys.argv[2:]  # whose tokenizers to parse ahead
    try:
        server = Server(idle, models)
    except Exception as exc:  # noqa: BLE001  (one line for `kvsnap warm start` to report: a busy lock, a bind, an import)
        print(f"error: {exc}", flush=True)
        sys.exit(1)
    try:
        server.serve()
        return
    except _Child as exc:
        child = exc  # outside the handler: no traceback of this run chains the server's
    go = os.read(child.go, 1)  # the server passes on the go of this run's kvsnap, or closes the pipe
    os.close(child.go)
    if go != b"G":  # that kvsnap gave up (it runs the command itself) or the server is gone
        os._exit(0)
    try:
        _become(child.request, child.fds)
    except Exception as exc:  # noqa: BLE001  (its kvsnap run waits on this child: say why, once)
        os.write(2, f"kvsnap: the warm process could not start this run ({exc})\n".encode())
        os._exit(1)
    from cli.main import run_here

    run_here()  # ends in SystemExit: the interpreter's normal exit, or cli.startup.leave's fast one


class Server:
    def __init__(self, idle: float, models: list[str] = ()):
        self.pid = os.getpid()
        self.idle = idle
        self.models = list(models)
        self.key = warm.key()
        folder = warm.checked_folder(create=True)
        self.path = warm.socket_path(folder, self.key)
        self.lock_path = folder / f"{self.key}.lock"
        self.lock_fd = warm.lock(self.lock_path)
        if self.lock_fd is None:
            raise warm.WarmError("already running for this environment")
        try:
            self._start()
        except BaseException:
            warm.unlock(self.lock_path, self.lock_fd)
            raise

    def _start(self) -> None:
        self.started = time.time()
        self.served = 0
        self.children: dict[int, _Run] = {}  # by pid
        self.imports_s = _preload()
        self.parsed = _parse_ahead(self.models)
        _check_threads()
        gc.collect()
        gc.freeze()  # children never walk (nor copy, by touching) what the imports made
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # ours to remove: its lock was free, so its server is gone
        self.listener: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o077)
        try:
            self.listener.bind(str(self.path))
        finally:
            os.umask(old)
        self.listener.listen(64)
        self.inode = os.stat(self.path).st_ino

    def serve(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        print(f"ready {self.pid} {self.imports_s:.2f} {json.dumps(self.parsed)}", flush=True)
        _detach_stdio()
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ, ("accept", None))
        last = time.monotonic()
        try:
            while True:
                if self.listener is None and not self.children:
                    return
                wait = None if self.children else max(0.0, last + self.idle - time.monotonic())
                events = self.sel.select(wait)
                if not events and not self.children and time.monotonic() - last >= self.idle:
                    return
                for sel_key, _ in events:
                    kind, data = sel_key.data
                    if kind == "accept":
                        if self._accept() == "stop":
                            self._stop_listening()  # the runs under way finish; no new one starts
                    elif kind == "exit":
                        self._reap(data)
                    else:
                        self._from_client(data)
                last = time.monotonic()
        finally:
            if os.getpid() == self.pid:
                self._close()

    def _accept(self) -> str | None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return None
        fds: list[int] = []
        try:
            conn.settimeout(ACCEPT_TIMEOUT)
            if warm.peer_uid(conn) != os.getuid():
                conn.close()
                return None
            msg, fds, _flags, _addr = socket.recv_fds(conn, 1, 3)
            request = warm.recv_frame(conn)
            if not isinstance(request, dict):
                raise warm.WarmError("not a request")
            op = request.get("op")
            if op == "status":
                warm.send_frame(conn, self._status())
                conn.close()
                return None
            if op == "stop":
                warm.send_frame(conn, {"pid": self.pid, "stopping": True, "running": len(self.children)})
                conn.close()
                return "stop"
            if op != "run" or msg != b"R" or len(fds) != 3 or request.get("key") != self.key:
                warm.send_frame(conn, {"refused": "another environment" if op == "run" else f"op {op!r}"})
                raise warm.WarmError("refused")
            go_read, go_write = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(go_write)
                self._in_child(conn)
                raise _Child(request, fds, go_read)
            os.close(go_read)
            pidfd = os.pidfd_open(pid)
            self.children[pid] = _Run(conn, pidfd, go_write)
            self.sel.register(pidfd, selectors.EVENT_READ, ("exit", pid))
            self.sel.register(conn, selectors.EVENT_READ, ("client", pid))
            conn.settimeout(ACCEPT_TIMEOUT)
            warm.send_frame(conn, {"pid": pid})
        except _Child:
            raise
        except (OSError, warm.WarmError, ValueError):
            if not any(conn is run.conn for run in self.children.values()):
                conn.close()
        finally:
            if os.getpid() == self.pid:
                for fd in fds:
                    os.close(fd)
        return None

    def _in_child(self, conn: socket.socket) -> None:
        """Close in a new child what is the server's: its sockets, pidfds, lock and selector."""
        self.sel.close()
        for run in self.children.values():
            run.conn.close()
            os.close(run.pidfd)
            if run.go is not None:
                os.close(run.go)
        conn.close()
        if self.listener is not None:
            self.listener.close()
        os.close(self.lock_fd)

    def _reap(self, pid: int) -> None:
        run = self.children.pop(pid)
        self.sel.unregister(run.pidfd)
        os.close(run.pidfd)
        if run.go is not None:
            os.close(run.go)
        _, status = os.waitpid(pid, 0)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(run.conn)
        with contextlib.suppress(OSError):
            warm.send_frame(run.conn, {"status": status})
        run.conn.close()

    def _from_client(self, pid: int) -> None:
        """A run's connection is readable: its go, or it closed (its ``kvsnap run`` is gone) or broke protocol."""
        run = self.children[pid]
        if run.go is not None:
            passed = False
            with contextlib.suppress(OSError):
                if run.conn.recv(1) == b"G":
                    os.write(run.go, b"G")
                    passed = True
                    self.served += 1
            os.close(run.go)  # passed on, or not: the child's read returns either way
            run.go = None
            if passed:
                return  # from now on, readable means gone
            self.sel.unregister(run.conn)  # no go: the child exits without running anything
            return
        self.sel.unregister(run.conn)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)

    def _status(self) -> dict:
        return {
            "pid": self.pid,
            "key": self.key,
            "started": self.started,
            "served": self.served,
            "running": len(self.children),
            "idle_s": self.idle,
            "imports_s": round(self.imports_s, 3),
            "tokenizers": self.parsed,
        }

    def _stop_listening(self) -> None:
        if self.listener is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(self.listener)
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == self.inode:  # a newer server's socket is not ours to remove
                os.unlink(self.path)
        self.listener.close()
        self.listener = None

    def _close(self) -> None:
        self._stop_listening()
        warm.unlock(self.lock_path, self.lock_fd)


_numpy_threads = 1


def _preload() -> float:
    """Import PRELOAD (``_check_threads`` then checks they started no thread)."""
    import importlib

    global _numpy_threads
    start = time.perf_counter()
    importlib.import_module(PRELOAD[0])
    # numpy's OpenBLAS starts its workers at import; it stops them around a fork (pthread_atfork).
    _numpy_threads = _native_threads()
    for name in PRELOAD[1:]:
        importlib.import_module(name)
    return time.perf_counter() - start


def _parse_ahead(models: list[str]) -> list[str]:
    """Parse the tokenizers of ``models`` that are ready on disk (a folder, or the default model once
    converted; nothing is installed or converted here), for every child to find parsed. Returns the
    models whose tokenizer was."""
    from kvsnap.config import DEFAULT_MODEL
    from kvsnap.errors import KvsnapError
    from kvsnap.models import resolve
    from kvsnap.models.plain_tokenizer import parse_ahead

    parsed = []
    for spec in models:
        folder = resolve.kvsnap_home() / "models" / DEFAULT_MODEL if spec == DEFAULT_MODEL else Path(spec)
        try:
            ready = resolve.is_ready(folder) if spec == DEFAULT_MODEL else (folder / "config.json").is_file()
            if ready and parse_ahead(folder):
                parsed.append(spec)
        except (KvsnapError, OSError):
            continue
    return parsed


def _check_threads() -> None:
    """Refuse to serve if anything but numpy's OpenBLAS started a thread (see the module's docstring)."""
    if threading.active_count() != 1 or _native_threads() > _numpy_threads:
        raise warm.WarmError(
            f"{_native_threads()} threads after the imports ({_numpy_threads} after numpy's): a fork would lose them"
        )


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _detach_stdio() -> None:
    """From now on the warm process writes nothing: its streams go to /dev/null (the starter's pipe closes)."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)


def _become(request: dict, fds: list[int]) -> None:
    """Make this forked child the process ``kvsnap run`` would have been: its streams, folder,
    environment, umask, arguments and signal handling."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.umask(int(request["umask"]))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = list(request["argv"])
    if sys.path:
        sys.path[0] = request["path0"]
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _reopen_stdio()
    from cli import startup

    startup.stamps.clear()  # stamps of the warm process's own start are not this run's
    startup.stamp("cli")


def _reopen_stdio() -> None:
    """New text streams on descriptors 0-2, made as the interpreter makes them at its start: in the
    encoding, and buffered (or not: ``-u``, PYTHONUNBUFFERED) as this environment made the warm
    process's own; line-buffered on a terminal, stderr always."""
    buffered = not sys.stdout.write_through
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        old = getattr(sys, name)
        raw = open(fd, mode + "b", buffering=-1 if buffered or mode == "r" else 0, closefd=False)  # noqa: SIM115
        stream = io.TextIOWrapper(
            raw,
            encoding=old.encoding,
            errors=old.errors,
            newline="\n",
            line_buffering=buffered and mode == "w" and (fd == 2 or os.isatty(fd)),
            write_through=not buffered and mode == "w",
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


if __name__ == "__main__":
    main()
