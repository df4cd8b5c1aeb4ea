"""``kvsnap keygen``: a new encryption key in a file of its own (for --encrypt, by $KVSNAP_KEY_FILE)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvsnap_cli import ui
from kvsnap_cli.common import guarded


@guarded
def keygen(file: Annotated[Path, typer.Argument(help="The key file to create (never an existing file).")]) -> None:
    """Write a new random AES-256 key to FILE, readable by you alone (0600).

    Point $KVSNAP_KEY_FILE at it, then save encrypted snapshots with --encrypt; every file sealed
    with it needs it to be read again, so keep a copy somewhere safe. The key never goes on a command
    line (where `ps` shows it to every user of the machine).

      kvsnap keygen ~/.config/kvsnap/key && export KVSNAP_KEY_FILE=~/.config/kvsnap/key

      kvsnap run --encrypt --prompt-file doc.txt --save doc.kv
    """
    from kvsnap.sealing import KEY_ENV, write_key_file

    key = write_key_file(file.expanduser())
    ui.say(f"wrote key {key.key_id} to {file} (mode 0600); use it with {KEY_ENV}={file}")
