"""What a block store folder holds: the marker that makes it one, kvsnap's own files, and the rest.

A store is a folder kvsnap made: the marker (``kvsnap-store.json``, format and version) is written
only into a new or empty folder, or next to an index an older kvsnap wrote (which must read as a
kvsnap index), so a mistyped ``--store`` path never turns someone's folder into a store whose
upkeep deletes their files. ``scan`` sorts the folder into the names kvsnap writes (blocks, logits,
its temp files, its index, marker and lock) and everything else, which upkeep reports and never
deletes. No torch here.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsnap.errors import StoreError
from kvsnap.format.atomic import locked
from kvsnap.sealing import KeyResolutionError, SealKey, resolve_key
from kvsnap.store.files import (
    DAMAGED_INDEX_NAME,
    INDEX_NAME,
    LOCK_NAME,
    MARKER_NAME,
    REPAIR_HINT,
    StoreFiles,
    write_file,
)
from kvsnap.store.index import INDEX_FORMAT, BlockIndex
from kvsnap.store.reading import listdir as _listdir
from kvsnap.store.reading import read_regular
from kvsnap.store.sealed_files import CIPHER, SealedStoreFiles

READABLE_VERSIONS = (1, 2)  # 2: an encrypted store (sealed_files)
_MARKER_LIMIT = 4096
_TOP_FILES = (INDEX_NAME, MARKER_NAME, DAMAGED_INDEX_NAME)
_TEMP = re.compile(r"^\.(.+)\.[A-Za-z0-9_]{8}\.tmp$")  # replace_whole's temp names: .<target>.<8 chars>.tmp
_NAMES = {"blocks": re.compile(r"^([0-9a-f]{32})\.blk$"), "blobs": re.compile(r"^([0-9a-f]{32})\.f32$")}
_KINDS = {"blocks": "block", "blobs": "blob"}


@dataclass(frozen=True, slots=True)
class Entry:
    """One thing in the store folder: ``kind`` is meta, block, blob, temp, folder (an empty folder at
    a block's or blob's name) or unknown (kvsnap did not write it: never deleted)."""

    path: Path
    rel: str
    kind: str


def open_store(files: StoreFiles, create: bool, key: SealKey | None = None) -> StoreFiles:
    """Make sure the folder is a kvsnap store; with ``create``, make a new or empty folder one
    (encrypted with ``key``). Returns the files of the store found: an encrypted store's
    (``sealed_files``) open with ``key``, else ``$KVSNAP_KEY_FILE``'s."""
    root = files.root
    if not create and not root.is_dir():
        raise StoreError(f"{root}: no kvsnap block store here")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"{root}: cannot create the store ({exc.strerror or exc})") from None
    if not root.is_dir():
        raise StoreError(f"{root}: not a folder")
    # Two processes creating one store take turns, so neither finds the other's first file.
    with locked(root, exclusive=True, best_effort=True):
        marker = _read_marker(files)
        if marker is not None:
            return _files_of(files, marker, key)
        if os.path.lexists(files.index_path):
            # A store an older kvsnap made (no marker): adopted only if its index is a kvsnap index.
            try:
                files.load_index()
            except StoreError as exc:
                why = str(exc).removesuffix(f"; {REPAIR_HINT}")
                raise StoreError(f"{root}: not a kvsnap block store (no {MARKER_NAME}, and {why})") from None
            _write_marker(files)
            return _files_of(files, files.marker(), key)
        if not _empty(root):
            raise StoreError(f"{root}: not a kvsnap block store (no {MARKER_NAME}); choose an empty or new folder")
        if not create:
            raise StoreError(f"{root}: no kvsnap block store here")
        if key is not None:
            files = SealedStoreFiles(root, key, os.urandom(16).hex())
        files.save_index(BlockIndex())
        _write_marker(files)
        return files


def _read_marker(files: StoreFiles) -> dict[str, Any] | None:
    try:
        text = read_regular(files.root, (MARKER_NAME,), "store marker", _MARKER_LIMIT)
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
        ok = data.get("format") == INDEX_FORMAT
        version = data.get("version")
    except (ValueError, AttributeError):
        ok, version = False, None
    if not ok:
        raise StoreError(f"{files.marker_path}: not a kvsnap store marker (damaged?)")
    if version not in READABLE_VERSIONS:
        raise StoreError(f"{files.marker_path}: store format version {version!r} is not one this kvsnap reads")
    return data


def _files_of(files: StoreFiles, marker: dict[str, Any], key: SealKey | None) -> StoreFiles:
    """The files of a store whose marker is ``marker``: a plain store refuses a key (its files would
    stay in the clear), an encrypted one needs its own."""
    root = files.root
    sealed = marker.get("sealed")
    if marker["version"] == 1:
        if key is not None:
            raise StoreError(f"{root}: this store is not encrypted; an encrypted one needs a new folder")
        return files
    if not isinstance(sealed, dict) or sealed.get("cipher") != CIPHER or not isinstance(sealed.get("key_id"), str):
        raise StoreError(f"{files.marker_path}: not a kvsnap store marker (damaged?)")
    store_id = sealed.get("store_id", "")
    if not isinstance(store_id, str) or not re.fullmatch(r"([0-9a-f]{32})?", store_id):
        raise StoreError(f"{files.marker_path}: not a kvsnap store marker (damaged?)")
    try:
        key = resolve_key(sealed["key_id"], key, what=f"{root}: encrypted store", other_key="of another key")
    except KeyResolutionError as exc:
        raise StoreError(str(exc)) from None
    return SealedStoreFiles(root, key, store_id)


def _write_marker(files: StoreFiles) -> None:
    write_file(files.marker_path, [json.dumps(files.marker()).encode()])


def _empty(root: Path) -> bool:
    """Nothing in the folder but what making a store leaves (a lock file, a killed writer's temp files)."""
    return all(e.rel == LOCK_NAME or e.kind == "temp" for e in _top(root))


def scan(root: Path) -> list[Entry]:
    """Everything in the folder, sorted into what kvsnap wrote and what it did not."""
    entries = []
    for e in _top(root):
        if e.kind != "folder":
            entries.append(e)
            continue
        for sub in _listdir(e.path):
            rel = f"{e.rel}/{sub.name}"
            if not (re.fullmatch(r"[0-9a-f]{2}", sub.name) and sub.is_dir(follow_symlinks=False)):
                entries.append(Entry(Path(sub.path), rel + _what(sub), "unknown"))
                continue
            for item in _listdir(sub.path):
                entries.append(_inner(e.rel, sub.name, item))
    return entries


def _top(root: Path) -> list[Entry]:
    entries = []
    for item in _listdir(root):
        name, regular = item.name, item.is_file(follow_symlinks=False)
        temp = _TEMP.match(name)
        if name in (*_TOP_FILES, LOCK_NAME):
            kind = "meta"
        elif temp and temp.group(1) in _TOP_FILES and regular:
            kind = "temp"
        elif name in _NAMES and item.is_dir(follow_symlinks=False):
            kind = "folder"  # blocks/ or blobs/: scan looks inside
        else:
            kind = "unknown"
        entries.append(Entry(Path(item.path), name + (_what(item) if kind == "unknown" else ""), kind))
    return entries


def _inner(top: str, prefix: str, item: os.DirEntry) -> Entry:
    name, regular = item.name, item.is_file(follow_symlinks=False)
    rel = f"{top}/{prefix}/{name}"
    own = _NAMES[top].match(name)
    temp = _TEMP.match(name)
    if own and own.group(1)[:2] == prefix:
        if regular:
            return Entry(Path(item.path), rel, _KINDS[top])
        if item.is_dir(follow_symlinks=False) and not _listdir(item.path):
            return Entry(Path(item.path), rel, "folder")
    elif temp and regular:
        inner = _NAMES[top].match(temp.group(1))
        if inner and inner.group(1)[:2] == prefix:
            return Entry(Path(item.path), rel, "temp")
    return Entry(Path(item.path), rel + _what(item), "unknown")


def _what(item: os.DirEntry) -> str:
    if item.is_symlink():
        return " (a link)"
    if item.is_dir(follow_symlinks=False):
        return " (a folder)"
    if not item.is_file(follow_symlinks=False):
        return " (not a regular file)"
    return ""


def remove_own(path: Path) -> bool:
    """Delete a file kvsnap wrote (or an empty folder at such a name); anything else stays."""
    try:
        mode = os.lstat(path).st_mode
        if stat.S_ISREG(mode):
            path.unlink()
        elif stat.S_ISDIR(mode):
            path.rmdir()
        else:
            return False
    except OSError:
        return False
    return True


def remove_new_store(root: Path, *, keep_folder: bool = False) -> None:
    """Undo a store a failed call just made: its own files and folders go, anything else stays."""
    for e in scan(root):
        if e.kind in ("meta", "block", "blob", "temp", "folder"):
            remove_own(e.path)
    for top in _NAMES:
        for sub in _listdir(root / top):
            with contextlib.suppress(OSError):
                os.rmdir(sub.path)
        with contextlib.suppress(OSError):
            (root / top).rmdir()
    if not keep_folder:
        with contextlib.suppress(OSError):
            root.rmdir()


# -- checked reads and whole-file writes -----------------------------------------------------------
