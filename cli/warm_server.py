"""The warm process itself (see ``cli.warm``): preload, then fork a child per ``kvsnap run`` handed over.

Started by ``kvsnap warm start`` as ``python -c 'from cli.warm_server import main; main()' READY_FD
IDLE [MODEL ...]`` in a new session (no terminal). It writes one line on READY_FD ("ready PID
IMPORT_SECONDS KEY PARSED", or "error: ..."), and from then on writes nothing. One thread, one
``select`` loop over: new connections; each run's connection (its go, then its close: that
``kvsnap run`` is gone, so its child gets SIGTERM, as a terminal's hangup would end it); each
child's exit (a pidfd), sent back to its ``kvsnap run`` as a wait status; and SIGTERM (a wakeup
descriptor): stop taking runs, pass the SIGTERM on to the runs under way, return their statuses,
exit. ``kvsnap warm stop`` is the same without the SIGTERM: the runs under way finish.

It imports no ``cli`` module but ``cli.warm``, ``cli.warm_client`` and ``cli.warm_child`` (``cli.ui``
makes its rich consoles at import, from the process's standard streams), and no typer or rich (they
read the terminal's environment at import). Nothing it imports may run a thread: a fork copies only
the thread that calls it, so one started before would be missing, its locks held, in every child
(checked before serving; numpy's OpenBLAS workers stop around a fork by themselves). It holds a lock
on ``KEY.lock`` as long as it lives: a second ``warm start`` of the same key sees it and leaves, and
a socket whose lock is free is a dead one's, which is removed.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import selectors
import signal
import socket
import sys
import time
from dataclasses import dataclass

from cli import warm, warm_child, warm_client, warm_preload

REQUEST_TIMEOUT = 5.0  # seconds a connection may take to send its whole request
HELD = [getattr(signal, name) for name in warm_client.FORWARDED]  # blocked from the fork to the run's start


class _Child(Exception):
    """Raised in a forked child to leave the server's loop and become its run."""

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
    ready = int(sys.argv[1])
    idle = float(sys.argv[2])
    models = sys.argv[3:]  # whose tokenizers to parse ahead
    try:
        server = Server(idle, models)
    except Exception as exc:  # noqa: BLE001  (one line for `kvsnap warm start`: a busy lock, a bind, an import)
        os.write(ready, f"error: {exc}\n".encode())
        sys.exit(1)
    try:
        server.serve(ready)
        return
    except _Child as exc:
        child = exc  # outside the handler: no traceback of this run chains the server's
    warm_child.run(child.request, child.fds, child.go, server.env_added)


class Server:
    def __init__(self, idle: float, models: list[str] = ()):
        self.pid = os.getpid()
        self.idle = idle
        self.key = warm.key()
        folder = warm.checked_folder(create=True)
        self.path = warm.socket_path(folder, self.key)
        self.lock_path = folder / f"{self.key}.lock"
        self.lock_fd = warm.lock(self.lock_path)
        if self.lock_fd is None:
            raise warm.WarmError("already running for this environment")
        self.listener: socket.socket | None = None
        try:
            self._start(list(models))
        except BaseException:
            self._stop_listening()
            warm.unlock(self.lock_path, self.lock_fd)
            raise

    def _start(self, models: list[str]) -> None:
        self.started = time.time()
        self.served = 0
        self.terminating = False
        self.children: dict[int, _Run] = {}  # by pid
        self.context = warm.context(self.pid)
        env_before = dict(os.environ)
        self.imports_s = warm_preload.preload()
        self.parsed = warm_preload.parse_ahead(models)
        warm_preload.check_threads()
        # What the imports set in the environment, a child sets too (it would have, importing them).
        self.env_added = {k: v for k, v in os.environ.items() if env_before.get(k) != v}
        if warm.key() != self.key:
            raise warm.WarmError("the imports changed what the key covers; runs here would differ")
        gc.collect()
        gc.freeze()  # children never walk (nor copy, by touching) what the imports made
        with contextlib.suppress(Exception):  # C stdio a library wrote during the imports: never a child's
            import ctypes

            ctypes.CDLL(None).fflush(None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # ours to remove: its lock was free, so its server is gone
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o077)
        try:
            self.listener.bind(str(self.path))
        finally:
            os.umask(old)
        self.listener.listen(64)
        self.inode = os.stat(self.path).st_ino

    def serve(self, ready: int) -> None:
        self.sel = selectors.DefaultSelector()
        self.wake = socket.socketpair()  # (read, write): a signal's byte wakes the select
        wake_read, wake_write = self.wake
        wake_read.setblocking(False)
        wake_write.setblocking(False)
        signal.set_wakeup_fd(wake_write.fileno())
        signal.signal(signal.SIGTERM, self._terminate)
        self.sel.register(wake_read, selectors.EVENT_READ, ("wake", None))
        self.sel.register(self.listener, selectors.EVENT_READ, ("accept", None))
        last = time.monotonic()
        try:
            os.write(ready, f"ready {self.pid} {self.imports_s:.2f} {self.key} {json.dumps(self.parsed)}\n".encode())
            os.close(ready)
            _detach_stdio()
            while self.listener is not None or self.children:
                wait = None if self.children else min(86400.0, max(0.0, last + self.idle - time.monotonic()))
                events = self.sel.select(wait)
                if not events and not self.children and time.monotonic() - last >= self.idle:
                    return
                for sel_key, _ in events:
                    kind, data = sel_key.data
                    if kind == "wake":
                        with contextlib.suppress(OSError):
                            wake_read.recv(64)
                    elif kind == "accept" and self.listener is not None:
                        if self._accept() == "stop":
                            self._stop_listening()  # the runs under way finish; no new one starts
                    elif kind == "exit":
                        self._reap(data)
                    elif kind == "client":
                        self._from_client(data)
                if self.terminating:
                    self._end_runs()
                last = time.monotonic()
        finally:
            if os.getpid() == self.pid:
                self._close()

    def _terminate(self, _signum: int, _frame: object) -> None:
        self.terminating = True  # acted on in the loop (the wakeup descriptor ends its select)

    def _end_runs(self) -> None:
        """SIGTERM: no new run; the runs under way get it too (their kvsnap hears how they ended)."""
        self._stop_listening()
        for pid, run in self.children.items():
            if run.go is not None:  # not started: it exits without running anything
                os.close(run.go)
                run.go = None
            _terminate_child(pid)

    def _accept(self) -> str | None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return None
        fds: list[int] = []
        try:
            deadline = time.monotonic() + REQUEST_TIMEOUT
            conn.settimeout(REQUEST_TIMEOUT)
            peer_pid, peer_uid = warm.peer(conn)
            if peer_uid != os.getuid():
                raise warm.WarmError("another user")
            request, fds = warm.recv_frame(conn, max_fds=4)
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            op = request.get("op") if isinstance(request, dict) else None
            if op == "status":
                warm.send_frame(conn, self._status())
                return None
            if op == "stop":
                warm.send_frame(conn, {"pid": self.pid, "stopping": True, "running": len(self.children)})
                return "stop"
            refusal = self._refusal(op, request, fds, peer_pid)
            if refusal:
                warm.send_frame(conn, {"refused": refusal})
                return None
            self._fork(conn, request, fds)
            conn = None  # the run's now
        except _Child:
            raise
        except (OSError, warm.WarmError, ValueError):
            pass
        finally:
            if os.getpid() == self.pid:
                for fd in fds:
                    os.close(fd)
                if conn is not None:
                    conn.close()
        return None

    def _refusal(self, op: object, request: dict, fds: list[int], peer_pid: int) -> str | None:
        if op != "run" or len(fds) != 4:
            return f"not a run ({op!r})"
        if request.get("key") != self.key:
            return "another environment"
        try:
            if warm.context(peer_pid) != self.context:
                return "another context (namespaces, cgroup, groups, CPU set, limits or niceness)"
        except OSError:
            return "a context that cannot be read"
        return None

    def _fork(self, conn: socket.socket, request: dict, fds: list[int]) -> None:
        go_read, go_write = os.pipe()
        held = signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
        try:
            pid = os.fork()
        except OSError:
            os.close(go_read)
            os.close(go_write)
            raise
        finally:
            if os.getpid() == self.pid:
                signal.pthread_sigmask(signal.SIG_SETMASK, held)
        if pid == 0:
            os.close(go_write)
            self._in_child(conn)
            raise _Child(request, fds, go_read)
        os.close(go_read)
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            os.close(go_write)  # the child sees no go and exits
            os.waitpid(pid, 0)
            raise
        run = self.children[pid] = _Run(conn, pidfd, go_write)
        self.sel.register(pidfd, selectors.EVENT_READ, ("exit", pid))
        self.sel.register(conn, selectors.EVENT_READ, ("client", pid))
        try:
            warm.send_frame(conn, {"pid": pid}, [pidfd])
        except OSError:  # that kvsnap is gone: no go will come; the child exits, and is reaped
            os.close(go_write)
            run.go = None
            self.sel.unregister(conn)

    def _in_child(self, conn: socket.socket) -> None:
        """Close in a new child what is the server's: its sockets, pidfds, pipes, lock and selector."""
        signal.set_wakeup_fd(-1)
        for end in self.wake:
            end.close()
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
        run = self.children.pop(pid, None)
        if run is None:
            return
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
        run = self.children.get(pid)
        if run is None:
            return
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
        _terminate_child(pid)

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
        with contextlib.suppress(KeyError, ValueError, AttributeError):
            self.sel.unregister(self.listener)
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == self.inode:  # a newer server's socket is not ours to remove
                os.unlink(self.path)
        self.listener.close()
        self.listener = None

    def _close(self) -> None:
        self._stop_listening()
        warm.unlock(self.lock_path, self.lock_fd)


def _terminate_child(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGCONT)  # a run stopped by ^Z acts on it too


def _detach_stdio() -> None:
    """From now on the warm process writes nothing: its streams go to /dev/null (the starter's pipe closes)."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)


if __name__ == "__main__":
    main()
