"""``kvsnap run``'s side of a warm process (cli.warm): hand the command over, forward signals, exit as the run did.

Stdlib only, and imported before anything else of the CLI: a run handed over costs this process
the interpreter and these few modules.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import sys

from cli import warm

# What this process passes on to the run, unless it ignores them (then the run ignores them too).
FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGWINCH", "SIGCONT")
# Dispositions a run inherits from this process: the forwarded ones, ^Z's, and what Python sets itself.
INHERITED = (*FORWARDED, "SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGPIPE", "SIGXFSZ", "SIGALRM")


def hand_over(argv: list[str]) -> None:
    """Run this command in a warm process if one with this process's key is up, and exit with its status.

    Returns (having done nothing that shows) when there is none, or when anything fails before the
    run has started. The warm process forks the run's child at once, but the child waits for this
    process's go (b"G") before it does anything: a ``kvsnap run`` that gave up waiting (and runs the
    command itself) never has its command run twice. From the go on, this process only forwards
    signals and waits, and never returns.
    """
    if not warm.enabled() or not warm.wanted(argv):
        return
    try:
        folder = warm.checked_folder(create=False)  # before the key: most runs have no warm process
        if _names_own_descriptors(argv):
            return  # `--prompt-file /dev/fd/3` names a descriptor of this process: run it here
        for fd in (0, 1, 2):
            os.fstat(fd)  # a closed standard stream: leave such a run to this process
        request = _request(argv)
        sock = warm.connect(warm.socket_path(folder, request["key"]))
    except (OSError, warm.WarmError):
        return
    try:
        _run_remotely(sock, request)
    except KeyboardInterrupt:  # ^C before the go: nothing has started, and nothing will
        os._exit(130)


def _request(argv: list[str]) -> dict:
    return {
        "op": "run",
        "key": warm.key(),
        "argv": [sys.argv[0], *argv],
        "path0": sys.path[0] if sys.path else "",
        "env": dict(os.environ),
        "umask": _umask(),
        "ignored": [name for name in INHERITED if signal.getsignal(getattr(signal, name)) is signal.SIG_IGN],
        "mask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    }


def _run_remotely(sock: socket.socket, request: dict) -> None:
    cwd = -1
    pidfd = -1
    previous: dict[int, object] = {}
    try:
        cwd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the folder itself, not its name
        warm.send_frame(sock, request, [0, 1, 2, cwd])
        reply, fds = warm.recv_frame(sock, max_fds=1)
        pid = reply.get("pid") if isinstance(reply, dict) else None
        if not isinstance(pid, int) or len(fds) != 1:  # refused: another key or context
            for fd in fds:
                os.close(fd)
            raise warm.WarmError(str(reply))
        pidfd = fds[0]
        previous = _forward_signals(pidfd, request["ignored"])  # first: a signal from the go on reaches the run
        sock.sendall(b"G")
    except (OSError, warm.WarmError):
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if pidfd >= 0:
            os.close(pidfd)
        sock.close()  # the child, if any, sees no go and exits without running anything
        return
    finally:
        if cwd >= 0:
            os.close(cwd)
    sock.settimeout(None)
    try:
        reply, _ = warm.recv_frame(sock)
        status = reply.get("status") if isinstance(reply, dict) else None
    except (OSError, warm.WarmError):
        status = None
    if not isinstance(status, int):
        # The warm process died (SIGKILL, a crash). The run cannot be waited for (not our child) but
        # can be watched: return only once it is over, so no file it writes is still being written.
        os.write(2, b"kvsnap: lost the warm process; waiting for the run to end\n")
        _wait_for_exit(pidfd)
        os.write(2, b"kvsnap: the run ended; its exit status is unknown\n")
        os._exit(1)
    _exit_like(status)


def _names_own_descriptors(argv: list[str]) -> bool:
    """Does an argument name one of this process's descriptors beyond 0-2 (``/dev/fd/3``,
    ``<(cmd)``)? Only the standard streams are handed over."""
    own = ("/dev/fd/", "/proc/self/", "/proc/thread-self/", f"/proc/{os.getpid()}/")
    return any(marker in arg for arg in argv for marker in own)


def _umask() -> int:
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def _forward_signals(pidfd: int, ignored: list[str]) -> dict[int, object]:
    """Send the run's child what this process receives (not what it ignores); ^Z stops both. Returns
    the handlers replaced. A pidfd names the child: no other process that reused its pid is signalled."""

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signum)

    def stop(signum: int, _frame: object) -> None:
        # Stop the child, then this process as ^Z would have (the shell sees a stopped job); a SIGCONT
        # (fg, bg) resumes this process, is forwarded, and the child goes on.
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGSTOP)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        signal.signal(signum, stop)

    previous = {}
    for name in FORWARDED:
        if name not in ignored:
            signum = getattr(signal, name)
            previous[signum] = signal.signal(signum, forward)
    if "SIGTSTP" not in ignored:
        previous[signal.SIGTSTP] = signal.signal(signal.SIGTSTP, stop)
    return previous


def _wait_for_exit(pidfd: int) -> None:
    while True:
        with contextlib.suppress(InterruptedError):
            if select.select([pidfd], [], [])[0]:
                return


def _exit_like(status: int) -> None:
    """End this process as the child ended: its exit code, or killed by its signal (without a core
    dump of this process: the child's is the one that tells anything)."""
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        import resource

        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
        signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)
