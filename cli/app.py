"""The kvsnap app: its commands, each a thin wrapper over the library (``kvsnap_cli.main`` runs it)."""

from __future__ import annotations

from typing import Annotated

import typer

from kvsnap_cli import calibrate_cmd, chat, inspect_cmd, keygen_cmd, models_cmd, pull, run, serve, store_cmd
from kvsnap_cli.common import state

app = typer.Typer(
    name="kvsnap",
    help=(
        "Resumable local LLM sessions: the KV cache is saved to a compressed .kv snapshot, and a resume "
        "loads the matching prefix (no recompute) and prefills only what is new."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from kvsnap import __version__

        typer.echo(f"kvsnap {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", metavar="", help="Show full tracebacks on errors.")] = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version", "-V", metavar="", callback=_version, is_eager=True, help="Print kvsnap's version and exit."
        ),
    ] = False,
) -> None:
    if debug:
        state["debug"] = True


def unwrap(doc: str | None) -> str:
    """A docstring as help text: each paragraph one line (typer keeps single line breaks inside later
    paragraphs, which showed as stray breaks), example lines (indented) kept as they are."""
    import inspect

    paragraphs = []
    for para in inspect.cleandoc(doc or "").split("\n\n"):
        lines = para.splitlines()
        paragraphs.append(para if any(line.startswith("  ") for line in lines) else " ".join(lines))
    return "\n\n".join(paragraphs)


commands = (
    ("chat", chat.chat),
    ("run", run.run),
    ("serve", serve.serve),
    ("inspect", inspect_cmd.inspect),
    ("pull", pull.pull),
    ("calibrate", calibrate_cmd.calibrate),
    ("keygen", keygen_cmd.keygen),
)
for name, command in commands:
    app.command(name, help=unwrap(command.__doc__))(command)
for command in (*store_cmd.app.registered_commands, *models_cmd.app.registered_commands):
    command.help = unwrap(command.help or command.callback.__doc__)
app.add_typer(store_cmd.app, name="store", short_help="Look after a block store of KV blocks shared by many sessions.")
app.add_typer(models_cmd.app, name="models", short_help="List or remove the models kvsnap downloaded or converted.")
