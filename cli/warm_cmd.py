"""``kvsnap warm``: start, stop and list warm processes, which take ``kvsnap run`` past its imports (cli.warm)."""

from __future__ import annotations

import json
import math
import os
import selectors
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
        "Python, packages, kvsnap sources, settings and limits (KVSNAP_WARM=0 turns its use off). Linux only."
    ),
    no_args_is_help=True,
)
Json = Annotated[bool, typer.Option("--json", metavar="", help="Print one JSON object.")]
START_TIMEOUT = 120.0  # seconds: the imports take 2-5 s on a slow VM, far more on a cold disk
MAX_IDLE = 7 * 86400.0


class WarmStartError(KvsnapError):
    """A warm process could not be started or reached."""


@app.command("start")
@guarded
def start(
    idle: Annotated[
        float,
        typer.Option(min=1, max=MAX_IDLE, help="Exit after this many seconds without a run (default: 15 minutes)."),
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
    if not warm.supported():
        raise WarmStartError("a warm process needs Linux (SO_PEERCRED, pidfds, /proc)")
    if not math.isfinite(idle):
        raise WarmStartError("--idle must be a number of seconds")
    models = [m if m == DEFAULT_MODEL else str(Path(m).resolve()) for m in (model or [DEFAULT_MODEL])]
    current = _find_current()
    if current is not None:
        _report({**current, "already": True}, json_out)
        return
    ready_read, ready_write = os.pipe()
    flags = subprocess._args_from_interpreter_flags()  # -X, -O, -W ...: part of the key
    code = "from cli.warm_server import main; main()"
    try:
        proc = subprocess.Popen(
            [sys.executable, *flags, "-c", code, str(ready_write), repr(idle), *models],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd="/",
            start_new_session=True,  # no terminal: the user's ^C and hangup are not its
            pass_fds=(ready_write,),
        )
    finally:
        os.close(ready_write)
    with ui.status("starting a warm process (importing torch)"):
        line, output = _ready_line(proc, ready_read)
    fields = line.split(" ", 4)
    if fields[0] != "ready" or len(fields) != 5:
        proc.kill()
        proc.wait()
        tail = output.strip().splitlines()
        said = line.strip() or (tail[-1] if tail else "it exited")
        raise WarmStartError(f"the warm process did not start: {said}")
    _, pid, imports_s, key, parsed = fields
    if key != warm.key():
        # It imported another way than this process would (a relative PYTHONPATH, say): it would serve no run.
        proc.kill()
        proc.wait()
        raise WarmStartError("the warm process's environment differs from this one's; it would serve no run here")
    info = {"pid": int(pid), "imports_s": float(imports_s), "tokenizers": json.loads(parsed), "idle_s": idle}
    _report({**info, "already": False}, json_out)


@app.command("stop")
@guarded
def stop(
    pid: Annotated[int | None, typer.Option(help="Stop only the warm process with this pid.")] = None,
    json_out: Json = False,
) -> None:
    """Stop every warm process of this user, or the one given (runs under way finish first)."""
    stopped = []
    for path in _sockets():
        try:
            if pid is None or warm.ask(path, "status").get("pid") == pid:
                stopped.append(warm.ask(path, "stop"))
        except warm.WarmError:
            continue
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
            info = warm.ask(path, "status")
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
        age = time.time() - float(info.get("started") or time.time())
        use = "takes `kvsnap run` here" if info["current"] else "another environment (not used here)"
        ui.emit(
            f"pid {info.get('pid')}: up {age:.0f} s, {ui.plural(int(info.get('served') or 0), 'run')} served, "
            f"{info.get('running')} running; {use}\n"
        )
    if found and not warm.enabled():
        ui.note("KVSNAP_WARM=0: runs here do not use them")


def _sockets() -> list[Path]:
    if not warm.supported():
        return []
    try:
        folder = warm.checked_folder(create=False)
    except warm.WarmFolderError as exc:
        raise WarmStartError(str(exc)) from None
    except warm.WarmError:
        return []  # no folder: no warm process
    warm.prune(folder)
    return sorted(folder.glob("*.sock"))


def _find_current() -> dict | None:
    try:
        path = warm.socket_path(warm.checked_folder(create=True), warm.key())
    except warm.WarmError as exc:
        raise WarmStartError(str(exc)) from None
    try:
        return warm.ask(path, "status")
    except warm.WarmError:
        return None


def _ready_line(proc: subprocess.Popen, ready: int) -> tuple[str, str]:
    """The warm process's line on its ready descriptor ("ready ..." or "error: ..."), waiting at most
    START_TIMEOUT, and what it printed meanwhile (warnings from its imports, or a traceback)."""
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(ready, selectors.EVENT_READ, "ready")
    sel.register(proc.stdout.fileno(), selectors.EVENT_READ, "output")
    deadline = time.monotonic() + START_TIMEOUT
    line, output, open_ = b"", b"", 2
    while b"\n" not in line and open_ and time.monotonic() < deadline:
        for sel_key, _ in sel.select(deadline - time.monotonic()):
            chunk = os.read(sel_key.fd, 65536)
            if not chunk:
                sel.unregister(sel_key.fileobj)
                open_ -= 1
            elif sel_key.data == "ready":
                line += chunk
            else:
                output = (output + chunk)[-65536:]
    sel.close()
    os.close(ready)
    proc.stdout.close()  # the warm process writes nothing more; it may have printed warnings, kept above
    return line.decode(errors="replace").split("\n")[0], output.decode(errors="replace")


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
