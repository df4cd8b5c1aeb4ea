"""``kvsnap store export`` and ``import``: a stored session as a .kv snapshot, and a .kv snapshot into a store."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvsnap_cli import ui
from kvsnap_cli.common import guarded
from kvsnap_cli.store_args import DIR_HELP, Json, open_store, split


@guarded
def export(
    given: Annotated[
        list[str],
        typer.Argument(
            metavar="[DIR] NAME OUT.kv",
            help=f"NAME: a session's name in the store; OUT.kv: the .kv snapshot to write (replaced atomically if it "
            f"exists). DIR: {DIR_HELP}",
            show_default=False,
        ),
    ],
    json_out: Json = False,
) -> None:
    """Write a stored session as a .kv snapshot, usable with --resume and `kvsnap inspect`."""
    from kvsnap.store.interchange import session_export

    store_dir, (name, written) = split(given, "NAME", "OUT.kv")
    out = Path(written)
    export = session_export(open_store(store_dir), name)
    size = export.write(out)
    info = {
        "session": name,
        "path": str(out),
        "tokens": len(export.tokens),
        "blocks": len(export.blocks),
        "file_bytes": size,
        "codec": export.codec,
    }
    if json_out:
        ui.print_json(info)
    else:
        ui.say(
            f"wrote session {name!r} to {out}: {ui.plural(info['tokens'], 'token')}, "
            f"{ui.plural(info['blocks'], 'block')}, {ui.human_bytes(size)}"
        )


@guarded
def import_(
    given: Annotated[
        list[str],
        typer.Argument(
            metavar="[DIR] FILE.kv",
            help=f"FILE.kv: the .kv snapshot to add. DIR (created if missing): {DIR_HELP}",
            show_default=False,
        ),
    ],
    name: Annotated[str | None, typer.Option(help="Session name (default: the file name without .kv).")] = None,
    pin_it: Annotated[
        bool, typer.Option("--pin", metavar="", help="Pin the session: its blocks are kept from eviction.")
    ] = False,
    json_out: Json = False,
) -> None:
    """Add a .kv snapshot's blocks to the store (verified, stored once) and record it as a named session."""
    from kvsnap.errors import KvsnapError
    from kvsnap.format import sealed
    from kvsnap.sealing import key_from_env
    from kvsnap.store.folder import remove_new_store
    from kvsnap.store.interchange import import_snapshot

    store_dir, (given_file,) = split(given, "FILE.kv")
    file = Path(given_file)
    session = name if name is not None else file.stem
    existed = store_dir.exists()
    new = not existed or (store_dir.is_dir() and not any(store_dir.iterdir()))
    # An encrypted snapshot makes a new store an encrypted one: what was sealed stays sealed.
    key = key_from_env(required=f"importing the encrypted {file}") if new and sealed.is_sealed(file) else None
    try:
        store = open_store(store_dir, create=True, key=key)
        result = import_snapshot(store, file, session, pin=True if pin_it else None)
    except KvsnapError:
        if new:
            # Leave nothing behind of a store this import made for a file that could not be added.
            remove_new_store(store_dir, keep_folder=existed)
        raise
    info = {
        "session": session,
        "path": str(file),
        "stored_tokens": result.stored_tokens,
        "blocks": len(result.hashes),
        "new_blocks": result.new_blocks,
        "reused_blocks": result.reused_blocks,
        "evicted": len(result.evicted),
    }
    if json_out:
        ui.print_json(info)
    else:
        ui.say(
            f"imported {file} as session {session!r}: {ui.plural(result.stored_tokens, 'token')} stored, "
            f"{ui.plural(result.new_blocks, 'new block')}, {result.reused_blocks:,} already stored; "
            f"evicted {ui.plural(len(result.evicted), 'block')}"
        )
