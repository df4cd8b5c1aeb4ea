"""``kvsnap warm``: start, stop and list warm processes, which take ``kvsnap run`` past its imports (cli.warm)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from cli import ui, warm
from cli.common import guarded
from kvsnap.config import DEFAULT_MODEL
from kvsnap.errors import KvsnapError

app = typer.Typer(
    help=(
        "A warm process: imports torch and kvsnap once and stays up, so each `kvsnap run` starts its work "
        "at once (a new process spends seconds importing torch). Each run is still a fresh process, "
        "forked from the warm one; this user's runs only, and only those started with the same "
        "Python, packages, kvsnap sources and settings (KVSNAP_WARM=0 turns its use off)."
    ),
    no_args_is_help=True,
)
Json = Annotated[bool, typer.Option("--json", metavar="", help="Print one JSON object.")]
START_TIMEOUT = 120.0  # seconds: the imports take 2-5 s on a slow VM, far more on a cold disk


class WarmStartError(KvsnapError):
    """A warm process could not be started or reached."""


@app.command("start")
@guarded
def start(
    idle: Annotated[
        float, typer.Option(min=1, help="Exit after this many seconds without a run (default: 15 minutes).")
    ] = 900.0,
    model: Annotated[
        list[str] | None,
        typer.Option(
            help="A model whose tokenizer the warm process parses ahead (~0.3 s of each run): the default "
            "model if it is installed, or a model folder; repeat for more. Runs of other models work too."
        ),
    ] = None,
    json_out: Json = False,
) -> None:
    """Start a warm process for this environment (or report the one already up) and return once it is ready."""
    models = [str(Path(m).resolve()) if m != DEFAULT_MODEL else m for m in (model or [DEFAULT_MODEL])]
    current = _find_current()
    if current is not None:
        _report({**current, "already": True}, json_out)
        return
    proc = subprocess.Popen(
        [sys.executable, "-c", "from cli.warm_server import main; main()", repr(idle), *models],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd="/",
        start_new_session=True,  # no terminal: the user's ^C and hangup are not its
        close_fds=True,
    )
    with ui.status("starting a warm process (importing torch)"):
        line = _first_line(proc)
    if not line.startswith("ready "):
        proc.kill()
        proc.wait()
        raise WarmStartError(f"the warm process did not start: {line.strip() or 'no output'}")
    if proc.stdout is not None:
        proc.stdout.close()
    _, pid, imports_s, parsed = line.split(" ", 3)
    info = {"pid": int(pid), "imports_s": float(imports_s), "tokenizers": json.loads(parsed), "idle_s": idle}
    _report({**info, "already": False}, json_out)


@app.command("stop")
@guarded
def stop(json_out: Json = False) -> None:
    """Stop every warm process of this user (runs under way finish first)."""
    stopped = []
    for path in _sockets():
        try:
            reply = _ask(path, "stop")
        except warm.WarmError:
            continue
        stopped.append(reply)
    if json_out:
        ui.print_json({"stopped": stopped})
        return
    n = len(stopped)
    ui.emit(f"stopped {n} warm process{'' if n == 1 else 'es'}\n")


@app.command("status")
@guarded
def status(json_out: Json = False) -> None:
    """List this user's warm processes, and which one (if any) takes `kvsnap run` in this environment."""
    current_key = warm.key()
    found = []
    for path in _sockets():
        try:
            info = _ask(path, "status")
        except warm.WarmError:
            continue
        info["current"] = info.get("key") == current_key
        found.append(info)
    if json_out:
        ui.print_json({"enabled": warm.enabled(), "folder": str(warm.folder()), "processes": found})
        return
    if not found:
        ui.emit("no warm process (start one with: kvsnap warm start)\n")
    for info in found:
        age = time.time() - info["started"]
        use = "takes `kvsnap run` here" if info["current"] else "another environment (not used here)"
        ui.emit(
            f"pid {info['pid']}: up {age:.0f} s, {ui.plural(info['served'], 'run')} served, "
            f"{info['running']} running; {use}\n"
        )
    if found and not warm.enabled():
        ui.note("KVSNAP_WARM=0: runs here do not use them")


def _sockets() -> list:
    try:
        folder = warm.checked_folder(create=False)
    except warm.WarmError as exc:
        if not os.path.lexists(warm.folder()):
            return []
        raise WarmStartError(str(exc)) from None
    warm.prune(folder)
    return sorted(folder.glob("*.sock"))


def _ask(path, op: str) -> dict:
    sock = warm.connect(path)
    try:
        sock.sendall(b"?")  # the one byte that carries a run's descriptors
        warm.send_frame(sock, {"op": op})
        reply = warm.recv_frame(sock)
    except OSError as exc:
        raise warm.WarmError(str(exc)) from None
    finally:
        sock.close()
    if not isinstance(reply, dict):
        raise warm.WarmError("a malformed reply")
    return reply


def _find_current() -> dict | None:
    try:
        path = warm.socket_path(warm.checked_folder(create=True), warm.key())
        return _ask(path, "status")
    except warm.WarmError as exc:
        if "uid" in str(exc) or "not a folder" in str(exc):
            raise WarmStartError(str(exc)) from None
        return None


def _first_line(proc: subprocess.Popen) -> str:
    """The warm process's first line ("ready PID IMPORT_SECONDS" or an error), waiting at most START_TIMEOUT."""
    import selectors

    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + START_TIMEOUT
    data = b""
    while b"\n" not in data and time.monotonic() < deadline:
        if sel.select(deadline - time.monotonic()):
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                break
            data += chunk
    sel.close()
    return data.decode(errors="replace").split("\n")[0]


def _report(info: dict, json_out: bool) -> None:
    if json_out:
        ui.print_json(info)
        return
    if info["already"]:
        ui.emit(f"a warm process is already up for this environment (pid {info['pid']})\n")
        return
    parsed = f", tokenizer of {', '.join(info['tokenizers'])} parsed" if info["tokenizers"] else ""
    ui.emit(
        f"warm process {info['pid']} ready (imports took {info['imports_s']:.1f} s{parsed}); `kvsnap run` here "
        f"now skips them; it exits after {info['idle_s']:.0f} s without a run, or on `kvsnap warm stop`\n"
    )
