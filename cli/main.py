"""``kvsnap``: resumable local LLM sessions. Commands are thin wrappers over the library."""

from __future__ import annotations

from typing import Annotated

import typer

from cli import chat, inspect_cmd, pull, run, store_cmd
from cli.common import state

app = typer.Typer(
    name="kvsnap",
    help=(
        "Resumable local LLM sessions: the KV cache is saved to a compressed .kv snapshot, and a resume "
        "loads the matching prefix (no recompute) and prefills only what is new."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks on errors.")] = False,
) -> None:
    if debug:
        state["debug"] = True


app.command("chat")(chat.chat)
app.command("run")(run.run)
app.command("inspect")(inspect_cmd.inspect)
app.command("pull")(pull.pull)
app.add_typer(store_cmd.app, name="store")


def main() -> None:
    try:
        app()
    except BrokenPipeError:
        # `kvsnap run ... | head`: the reader left; quietly stop writing.
        import os
        import sys

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(1)


if __name__ == "__main__":
    main()
