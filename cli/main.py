"""``kvsnap``: resumable local LLM sessions. The entry point: run the command line in this process."""

from __future__ import annotations

from typing import Any

from kvsnap_cli import startup


def __getattr__(name: str) -> Any:
    if name == "app":  # `from kvsnap_cli.main import app`, the tests' way in
        from kvsnap_cli.app import app

        return app
    raise AttributeError(name)


def main() -> None:
    """Run the command line in this process."""
    startup.own_process = True
    startup.stamp("main")
    _fill_closed_streams()
    from kvsnap_cli.app import app

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


def _fill_closed_streams() -> None:
    """Standard streams the caller closed (``>&-``) read and write /dev/null, as ``print`` behaves
    without a stdout: the command still does its work (a --save, a store update) without a
    traceback, and no file kvsnap opens can take the free descriptor and receive its output."""
    import os
    import sys

    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        if getattr(sys, name) is not None:
            continue
        devnull = os.open(os.devnull, os.O_RDWR)
        if devnull != fd:
            os.dup2(devnull, fd)
            os.close(devnull)
        setattr(sys, name, open(fd, mode, encoding="utf-8", closefd=False))  # noqa: SIM115


if __name__ == "__main__":
    main()
