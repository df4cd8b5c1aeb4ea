"""``kvsnap``: resumable local LLM sessions. The entry point: hand the command to a warm process, or run it here.

The app (typer and every command module) is imported only once the command runs here: a command a
warm process takes (cli.warm) costs this process the interpreter and a few stdlib modules.
"""

from __future__ import annotations

from typing import Any

from cli import startup


def __getattr__(name: str) -> Any:
    if name == "app":  # `from cli.main import app`, the tests' way in
        from cli.app import app

        return app
    raise AttributeError(name)


def main() -> None:
    import sys

    from cli import warm_client

    warm_client.hand_over(sys.argv[1:])  # a warm process took the command: exits with its status
    run_here()


def run_here() -> None:
    """Run the command line in this process (``main``, or a warm process's child)."""
    startup.own_process = True
    startup.stamp("main")
    from cli.app import app

    try:
        app()
    except SystemExit as exc:  # how every command ends, typer's standalone mode
        startup.leave(exc.code)
        raise
    except BrokenPipeError:
        # `kvsnap run ... | head`: the reader left; quietly stop writing.
        import os
        import sys

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(1)
    finally:
        startup.exiting()


if __name__ == "__main__":
    main()
