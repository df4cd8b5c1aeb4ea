"""``kvsnap`` commands run in the test's own process (typer's CliRunner): no new interpreter, no
second torch import, the tiny model loads in a fraction of a second.

A real process is still the way for what only a process shows: its exit (tests/test_exit.py),
what it imports (``core_helpers.kvsnap_imports``), signals, and two programs at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from typer.testing import CliRunner


@dataclass(frozen=True)
class Ran:
    """What a command did, named as ``subprocess.CompletedProcess`` names it."""

    returncode: int
    stdout: str
    stderr: str


def kvsnap(*args: str | Path, input: str | None = None) -> Ran:
    """``kvsnap ARGS`` with ``input`` as its standard input (not a terminal, like a pipe).

    An exception the command lets escape is raised here: in a real process it would be a traceback
    and exit code 1, which an assertion on the exit code alone could mistake for a handled error.
    """
    from kvsnap_cli.main import app

    result = CliRunner().invoke(app, [str(a) for a in args], input=input)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception.with_traceback(result.exc_info[2])
    return Ran(result.exit_code, result.stdout, result.stderr)
