"""A warm process's child (cli.warm_server) becomes the ``kvsnap run`` that handed its command over."""

from __future__ import annotations

import io
import os
import signal
import sys

from cli.warm_client import INHERITED


def run(request: dict, fds: list[int], go: int, env_added: dict[str, str]) -> None:
    """Wait for the go, become the run, run its command. Never returns (SystemExit, or ``os._exit``).

    Until the go the forwarded signals stay blocked (the server blocked them around the fork): a
    SIGTERM sent to a run that has not started is held, and then acted on with the run's own
    disposition, never with the server's handler.
    """
    received = os.read(go, 1)  # the server passes on the go of this run's kvsnap, or closes the pipe
    os.close(go)
    if received != b"G":  # that kvsnap gave up (it runs the command itself) or the server is gone
        os._exit(0)
    try:
        become(request, fds, env_added)
    except Exception as exc:  # noqa: BLE001  (its kvsnap run waits on this child: say why, once)
        os.write(2, f"kvsnap: the warm process could not start this run ({exc})\n".encode())
        os._exit(1)
    from cli.main import run_here

    run_here()  # ends in SystemExit: the interpreter's normal exit, or cli.startup.leave's fast one


def become(request: dict, fds: list[int], env_added: dict[str, str]) -> None:
    """Make this forked child the process ``kvsnap run`` would have been: its streams, folder,
    environment, umask, arguments, signal dispositions and mask."""
    *streams, cwd = fds
    for target, fd in enumerate(streams):
        os.dup2(fd, target)
        os.close(fd)
    os.fchdir(cwd)
    os.close(cwd)
    os.umask(int(request["umask"]))
    env = dict(request["env"])
    for name, value in env_added.items():  # what the preloaded imports set, as they would have here
        env.setdefault(name, value)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = list(request["argv"])
    if sys.path:
        sys.path[0] = request["path0"]
    _reopen_stdio()
    from cli import startup

    startup.stamps.clear()  # stamps of the warm process's own start are not this run's
    startup.stamp("cli")
    ignored = set(request["ignored"])
    for name in INHERITED:
        signum = getattr(signal, name)
        if name in ignored:
            signal.signal(signum, signal.SIG_IGN)
        elif name == "SIGINT":
            signal.signal(signum, signal.default_int_handler)
        elif name not in ("SIGPIPE", "SIGXFSZ"):  # Python ignores these two itself, as it did there
            signal.signal(signum, signal.SIG_DFL)
    # Last: a signal held since the fork is delivered now, to the run's dispositions.
    signal.pthread_sigmask(signal.SIG_SETMASK, [signal.Signals(s) for s in request["mask"]])


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
