"""The files of a block store folder: where each thing lives, whole-file reads and writes, the lock.

    DIR/index.json              the BlockIndex as JSON, written atomically
    DIR/.lock                   fcntl lock file: writers exclusive, readers shared
    DIR/blocks/ab/<hash>.blk    one block's stored (encoded) bytes, named by its chained hash
    DIR/blobs/ab/<id>.f32       a session's last-position logits, named by their BLAKE2b digest

Every read is checked (size and checksum for blocks, digest for blobs) and fails as
``StoreError``; every write replaces a whole file (temp file, fsync, rename). No torch here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

from kvsnap.errors import StoreError
from kvsnap.format.atomic import locked, replace_whole
from kvsnap.hashing import checksum
from kvsnap.store.index import BlockIndex
from kvsnap.store.records import BlockRecord

INDEX_NAME = "index.json"
LOCK_NAME = ".lock"


class StoreFiles:
    """Paths and checked whole-file I/O under one store folder."""

    def __init__(self, root: Path):
        self.root = root
        self.index_path = root / INDEX_NAME

    @contextlib.contextmanager
    def lock(self, exclusive: bool) -> Iterator[None]:
        """Writers exclusive, readers shared; a lock file that cannot be opened is a ``StoreError``."""
        path = self.root / LOCK_NAME
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(locked(path, exclusive=exclusive))
            except OSError as exc:
                raise StoreError(f"{path}: cannot open the store's lock file ({exc.strerror or exc})") from None
            yield

    def block_path(self, h: bytes) -> Path:
        name = h.hex()
        return self.root / "blocks" / name[:2] / f"{name}.blk"

    def blob_path(self, blob_id: str) -> Path:
        if not re.fullmatch(r"[0-9a-f]{32}", blob_id):
            raise StoreError(f"invalid logits id {blob_id!r} in the store index")
        return self.root / "blobs" / blob_id[:2] / f"{blob_id}.f32"

    # -- index ------------------------------------------------------------------------------------

    def load_index(self) -> BlockIndex:
        try:
            text = self.index_path.read_bytes()
        except FileNotFoundError:
            return BlockIndex()
        except OSError as exc:
            raise StoreError(f"{self.index_path}: cannot read ({exc.strerror or exc})") from None
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):
            raise StoreError(f"{self.index_path}: store index is not valid JSON (damaged?)") from None
        try:
            return BlockIndex.from_json(data)
        except StoreError as exc:
            raise StoreError(f"{self.index_path}: {exc}") from None

    def save_index(self, index: BlockIndex) -> None:
        write_file(self.index_path, json.dumps(index.to_json(), separators=(",", ":"), ensure_ascii=True).encode())

    # -- blocks and blobs -------------------------------------------------------------------------

    def read_block(self, record: BlockRecord) -> bytes:
        path = self.block_path(record.hash)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise StoreError(f"{path}: block file is missing") from None
        except OSError as exc:
            raise StoreError(f"{path}: cannot read ({exc.strerror or exc})") from None
        if len(data) != record.stored_bytes or checksum(data) != record.checksum:
            raise StoreError(f"{path}: block is damaged (checksum mismatch)")
        return data

    def read_blob(self, blob_id: str) -> bytes:
        path = self.blob_path(blob_id)
        try:
            data = path.read_bytes()
        except OSError:
            raise StoreError(f"{path}: last-position logits are missing") from None
        if blob_digest(data) != blob_id:
            raise StoreError(f"{path}: last-position logits are damaged")
        return data

    def block_sound(self, record: BlockRecord, verify: bool) -> bool:
        """The block's file is there with its size (and, with ``verify``, passes its checksum)."""
        if verify:
            try:
                self.read_block(record)
            except StoreError:
                return False
            return True
        try:
            return self.block_path(record.hash).stat().st_size == record.stored_bytes
        except OSError:
            return False

    def blob_sound(self, blob_id: str) -> bool:
        try:
            self.read_blob(blob_id)
        except StoreError:
            return False
        return True

    def walk(self) -> Iterator[Path]:
        """Every file in the top folder, ``blocks/`` and ``blobs/``."""
        for folder in (self.root, self.root / "blocks", self.root / "blobs"):
            if not folder.is_dir():
                continue
            for dirpath, _, filenames in os.walk(folder):
                for name in filenames:
                    yield Path(dirpath) / name
                if folder == self.root:
                    break  # the top folder only: its subfolders are walked on their own


def blob_digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def write_file(path: Path, data: bytes | memoryview) -> None:
    """Write ``path`` whole or not at all (the store's own lock orders its writers)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_whole(path, [data])
    except OSError as exc:
        # The transaction ends without writing the index: the store is as it was (gc removes new files).
        raise StoreError(f"{path}: cannot write ({exc.strerror or exc})") from None
