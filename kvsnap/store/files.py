"""The files of a block store folder: what kvsnap writes there, checked reads and writes, the lock.

    DIR/kvsnap-store.json       the marker: this folder is a kvsnap block store (format, version)
    DIR/index.json              the BlockIndex as JSON, written atomically
    DIR/.lock                   fcntl lock file: writers exclusive, readers shared
    DIR/blocks/ab/<hash>.blk    one block's stored (encoded) bytes and its trailer (``blockfile``)
    DIR/blobs/ab/<id>.f32       a session's last-position logits, named by their BLAKE2b digest
    DIR/index.damaged.json      an index ``repair`` could not read, kept as it was

What makes a folder a store, and which names are kvsnap's, is ``folder``'s business. Every read
here goes through ``reading`` (a regular file only, no link followed, size checked before reading,
never more read than expected), so a damaged store is a ``StoreError``, never a hang or a gigabyte
read. Every write replaces a whole file (temp file, fsync, rename). No torch here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvsnap.errors import StoreError
from kvsnap.format.atomic import locked, replace_whole
from kvsnap.hashing import checksum
from kvsnap.store import blockfile
from kvsnap.store.index import INDEX_FORMAT, BlockIndex
from kvsnap.store.index_json import index_from_json, index_to_json
from kvsnap.store.reading import listdir, open_regular, read_at, read_regular
from kvsnap.store.records import BlockRecord, ChainInfo, record_problem

if TYPE_CHECKING:
    from kvsnap.sealing import SealKey

INDEX_NAME = "index.json"
LOCK_NAME = ".lock"
MARKER_NAME = "kvsnap-store.json"
DAMAGED_INDEX_NAME = "index.damaged.json"
# Far beyond any real index (a block's entry is a few hundred bytes) yet never a memory hazard.
INDEX_LIMIT = 1 << 30
BLOB_LIMIT = 64 << 20  # float32 logits of a 16M-token vocabulary
REPAIR_HINT = "repair rebuilds it from the block files (kvsnap store check --repair)"


class StoreFiles:
    """Paths and checked whole-file I/O under one store folder."""

    key: SealKey | None = None  # an encrypted store's (sealed_files)

    def __init__(self, root: Path):
        self.root = root
        self.index_path = root / INDEX_NAME
        self.marker_path = root / MARKER_NAME

    # -- paths and the lock ----------------------------------------------------------------------

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

    def _rel(self, path: Path) -> tuple[str, ...]:
        return path.relative_to(self.root).parts

    def blob_id(self, data: bytes) -> str:
        """The id (and file name) of a logits blob."""
        return blob_digest(data)

    def sealed_size(self, n: int) -> int:
        """The size of the file that holds ``n`` bytes (an encrypted store's adds its seal)."""
        return n

    def marker(self) -> dict:
        """What the store's marker file says (``folder``): its format and version."""
        return {"format": INDEX_FORMAT, "version": 1}

    # -- index ------------------------------------------------------------------------------------

    def load_index(self) -> BlockIndex:
        """The index; a missing one is an empty store only while no block file says otherwise."""
        hint = REPAIR_HINT
        try:
            text = read_regular(self.root, (INDEX_NAME,), "store index", INDEX_LIMIT)
        except FileNotFoundError:
            if self.has_blocks():
                raise StoreError(f"{self.index_path}: store index is missing, block files are here; {hint}") from None
            return BlockIndex()
        except StoreError as exc:
            raise StoreError(f"{exc}; {hint}") from None
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):
            raise StoreError(f"{self.index_path}: store index is not valid JSON (damaged?); {hint}") from None
        try:
            return index_from_json(data)
        except StoreError as exc:
            raise StoreError(f"{self.index_path}: {exc}; {hint}") from None

    def save_index(self, index: BlockIndex) -> None:
        text = json.dumps(index_to_json(index), separators=(",", ":"), ensure_ascii=True).encode()
        write_file(self.index_path, [text])

    def has_blocks(self) -> bool:
        for sub in listdir(self.root / "blocks"):
            if sub.is_dir(follow_symlinks=False) and any(e.name.endswith(".blk") for e in listdir(sub.path)):
                return True
        return False

    # -- blocks and blobs -------------------------------------------------------------------------

    def read_block(self, record: BlockRecord) -> bytes:
        """The block's stored bytes, checked against its index entry (size, checksum, trailer)."""
        path = self.block_path(record.hash)
        n = record.stored_bytes
        try:
            fd, size = open_regular(self.root, self._rel(path), "block file")
        except FileNotFoundError:
            raise StoreError(f"{path}: block file is missing") from None
        try:
            if size == n:  # written before block files had trailers: the stored bytes alone
                data, tail = read_at(fd, n + 1, 0), None
            elif n + blockfile.TAIL < size <= n + blockfile.TAIL + blockfile.TRAILER_LIMIT:
                data, tail = read_at(fd, n, 0), read_at(fd, size - n + 1, n)
            else:
                raise StoreError(f"{path}: block file holds {size:,} bytes, its entry {n:,} (damaged); not read")
        except OSError as exc:
            raise StoreError(f"{path}: cannot read ({exc.strerror or exc})") from None
        finally:
            os.close(fd)
        if len(data) != n or checksum(data) != record.checksum:
            raise StoreError(f"{path}: block is damaged (checksum mismatch)")
        if tail is not None and self._trailer(tail) != record:
            raise StoreError(f"{path}: block file's trailer does not match its index entry")
        return data

    @staticmethod
    def _trailer(tail: bytes) -> BlockRecord | None:
        length = blockfile.trailer_length(tail[-blockfile.TAIL :])
        if length is None or length + blockfile.TAIL != len(tail):
            return None
        try:
            return blockfile.parse_trailer(tail[:length])[0]
        except StoreError:
            return None

    def read_block_file(self, path: Path) -> tuple[BlockRecord, ChainInfo, bytes]:
        """A block file alone, with no index entry to go by: the entry and chain its trailer names, and
        its stored bytes (read only once the trailer says they can be a block of that chain).

        ``StoreError`` for a file without a trailer (written before trailers existed) or a damaged one.
        """
        fd, size = open_regular(self.root, self._rel(path), "block file")
        try:
            length = blockfile.trailer_length(read_at(fd, blockfile.TAIL, max(size - blockfile.TAIL, 0)))
            if length is None:
                raise StoreError("no trailer (a block file of an older kvsnap): it cannot prove what it holds")
            if length > blockfile.TRAILER_LIMIT or length + blockfile.TAIL > size:
                raise StoreError("its trailer is damaged")
            stored_size = size - length - blockfile.TAIL
            record, chain = blockfile.parse_trailer(read_at(fd, length, stored_size))
            if record.stored_bytes != stored_size:
                raise StoreError(f"it holds {stored_size:,} stored bytes, its trailer says {record.stored_bytes:,}")
            problem = record_problem(record, chain)
            if problem is not None:
                raise StoreError(problem)
            # No codec makes a block much bigger than its raw bytes: anything beyond is not read.
            if stored_size > 2 * record.raw_bytes + 65536:
                raise StoreError(f"{stored_size:,} stored bytes for {record.raw_bytes:,} raw bytes")
            return record, chain, read_at(fd, stored_size, 0)
        except OSError as exc:
            raise StoreError(f"cannot read ({exc.strerror or exc})") from None
        finally:
            os.close(fd)

    def read_blob(self, blob_id: str) -> bytes:
        path = self.blob_path(blob_id)
        try:
            data = read_regular(self.root, self._rel(path), "last-position logits", BLOB_LIMIT)
        except FileNotFoundError:
            raise StoreError(f"{path}: last-position logits are missing") from None
        if self.blob_id(data) != blob_id:
            raise StoreError(f"{path}: last-position logits are damaged")
        return data

    def blob_sound(self, blob_id: str) -> bool:
        try:
            self.read_blob(blob_id)
        except StoreError:
            return False
        return True

    def write(self, path: Path, parts: Sequence[bytes | memoryview]) -> None:
        """Write a block or blob file whole; its folders must be real folders inside the store."""
        folder = self.root
        for part in self._rel(path)[:-1]:
            folder = folder / part
            try:
                folder.mkdir()
            except FileExistsError:
                pass
            except OSError as exc:
                raise StoreError(f"{folder}: cannot create ({exc.strerror or exc})") from None
            try:
                real = stat.S_ISDIR(os.lstat(folder).st_mode)
            except OSError as exc:
                raise StoreError(f"{folder}: cannot create ({exc.strerror or exc})") from None
            if not real:
                raise StoreError(f"{folder}: not a folder (links inside the store are not followed)")
        write_file(path, parts)


def blob_digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def has_file(path: Path, size: int) -> bool:
    """A regular file of ``size`` bytes is at ``path`` (a link or special file there is not one)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == size


def write_file(path: Path, parts: Sequence[bytes | memoryview]) -> None:
    """Write ``path`` whole or not at all (the store's own lock orders its writers)."""
    try:
        replace_whole(path, list(parts))
    except OSError as exc:
        # The transaction ends without writing the index: the store is as it was (gc removes new files).
        raise StoreError(f"{path}: cannot write ({exc.strerror or exc})") from None
