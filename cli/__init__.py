"""The kvsnap command line: a thin typer app over the ``kvsnap`` library."""

from kvsnap_cli import startup

startup.stamp("cli")  # the interpreter is up; the CLI's own imports start
