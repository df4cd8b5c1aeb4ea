"""An encrypted block store's files: every file sealed with AES-256-GCM, names keyed. No torch here.

A store made with a key (``BlockStore(path, key=...)``, ``--encrypt``) says so in its marker (store
format version 2, the cipher and the key's id), and from then on:

- a block file is named by a keyed digest of its block hash (``SealKey.name``), not the hash, so its
  name tells nothing of the tokens (a chained hash of a guessed prompt would otherwise find it);
  a logits file likewise by a keyed digest of its bytes;
- every file (block: its stored bytes and trailer; logits; the index) is one sealed piece, bound to
  its path in the store: a file moved to another name, or any byte changed, fails to open;
- reads are bounded as a plain store's are, then opened, then checked as a plain store checks them.

A kvsnap without this module refuses the store at its marker ("store format version 2 is not one
this kvsnap reads"); this one refuses it without the key, or with another, in one line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from kvsnap.errors import StoreError
from kvsnap.hashing import checksum
from kvsnap.limits import MAX_BLOCK_BYTES
from kvsnap.sealing import OVERHEAD, SealError, SealKey
from kvsnap.store import blockfile
from kvsnap.store.files import BLOB_LIMIT, INDEX_LIMIT, INDEX_NAME, REPAIR_HINT, StoreFiles, write_file
from kvsnap.store.index import BlockIndex
from kvsnap.store.index_json import index_from_json, index_to_json
from kvsnap.store.reading import open_regular, read_at, read_regular
from kvsnap.store.records import BlockRecord, ChainInfo, record_problem

CIPHER = "AES-256-GCM"
# A block file read with no entry to bound it (repair, adoption): no block is larger than this.
_BLOCK_FILE_LIMIT = 2 * MAX_BLOCK_BYTES + blockfile.TAIL + blockfile.TRAILER_LIMIT + OVERHEAD


class SealedStoreFiles(StoreFiles):
    """``StoreFiles`` of an encrypted store: the same folder layout, sealed files, keyed names."""

    def __init__(self, root: Path, key: SealKey, store_id: str = ""):
        """``store_id``: the random id in the store's marker, which the index is sealed to ("": a store
        made before stores had one, whose index is bound to its path only)."""
        super().__init__(root)
        self.key = key
        self.store_id = store_id

    # -- names ------------------------------------------------------------------------------------

    def block_path(self, h: bytes) -> Path:
        name = self.key.name(b"block\x00" + h).hex()
        return self.root / "blocks" / name[:2] / f"{name}.blk"

    def blob_id(self, data: bytes) -> str:
        return self.key.name(b"blob\x00" + data).hex()

    def sealed_size(self, n: int) -> int:
        return n + OVERHEAD

    def marker(self) -> dict:
        sealed = {"cipher": CIPHER, "key_id": self.key.key_id, **({"store_id": self.store_id} if self.store_id else {})}
        return {**super().marker(), "version": 2, "sealed": sealed}

    # -- sealing ----------------------------------------------------------------------------------

    def _aad(self, path: Path) -> bytes:
        rel = "/".join(self._rel(path)).encode()
        # The index says which sessions and blocks the store holds: sealed to this store, another
        # store's index copied over it does not open. Blocks are named by content, so any store of
        # the key may hold one.
        if path == self.index_path and self.store_id:
            return b"store " + self.store_id.encode() + b"\x00" + rel
        return rel

    def _open(self, path: Path, sealed: bytes) -> bytes:
        try:
            return self.key.open(sealed, self._aad(path))
        except SealError:
            raise StoreError(f"{path}: fails authentication (another key, or the file was changed)") from None

    def write(self, path: Path, parts: Sequence[bytes | memoryview]) -> None:
        super().write(path, [self.key.seal(b"".join(parts), self._aad(path))])

    def _read_sealed(self, path: Path, limit: int, what: str) -> bytes:
        """The opened bytes of a sealed file of at most ``limit`` plaintext bytes."""
        try:
            fd, size = open_regular(self.root, self._rel(path), what)
        except FileNotFoundError:
            raise StoreError(f"{path}: {what} is missing") from None
        try:
            if size > limit + OVERHEAD:
                raise StoreError(f"{path}: {what} holds {size:,} bytes, more than it can (damaged); not read")
            sealed = read_at(fd, size + 1, 0)
        except OSError as exc:
            raise StoreError(f"{path}: cannot read ({exc.strerror or exc})") from None
        finally:
            os.close(fd)
        return self._open(path, sealed)

    # -- index ------------------------------------------------------------------------------------

    def load_index(self) -> BlockIndex:
        try:
            sealed = read_regular(self.root, (INDEX_NAME,), "store index", INDEX_LIMIT + OVERHEAD)
        except FileNotFoundError:
            if self.has_blocks():
                missing = f"{self.index_path}: store index is missing, block files are here"
                raise StoreError(f"{missing}; {REPAIR_HINT}") from None
            return BlockIndex()
        except StoreError as exc:
            raise StoreError(f"{exc}; {REPAIR_HINT}") from None
        try:
            data = json.loads(self._open(self.index_path, sealed))
            return index_from_json(data)
        except (ValueError, RecursionError, StoreError) as exc:
            raise StoreError(f"{self.index_path}: store index cannot be read ({exc}); {REPAIR_HINT}") from None

    def save_index(self, index: BlockIndex) -> None:
        text = json.dumps(index_to_json(index), separators=(",", ":"), ensure_ascii=True).encode()
        write_file(self.index_path, [self.key.seal(text, self._aad(self.index_path))])

    # -- blocks and blobs -------------------------------------------------------------------------

    def read_block(self, record: BlockRecord) -> bytes:
        path = self.block_path(record.hash)
        n = record.stored_bytes
        plain = self._read_sealed(path, n + blockfile.TAIL + blockfile.TRAILER_LIMIT, "block file")
        data, tail = plain[:n], plain[n:]
        if len(data) != n or checksum(data) != record.checksum:
            raise StoreError(f"{path}: block is damaged (checksum mismatch)")
        if self._trailer(tail) != record:
            raise StoreError(f"{path}: block file's trailer does not match its index entry")
        return data

    def read_block_file(self, path: Path) -> tuple[BlockRecord, ChainInfo, bytes]:
        try:
            plain = self._read_sealed(path, _BLOCK_FILE_LIMIT, "block file")
        except StoreError as exc:
            raise StoreError(str(exc).removeprefix(f"{path}: ")) from None
        length = blockfile.trailer_length(plain[-blockfile.TAIL :])
        if length is None or length > blockfile.TRAILER_LIMIT or length + blockfile.TAIL > len(plain):
            raise StoreError("its trailer is damaged")
        stored_size = len(plain) - length - blockfile.TAIL
        record, chain = blockfile.parse_trailer(plain[stored_size : stored_size + length])
        if record.stored_bytes != stored_size:
            raise StoreError(f"it holds {stored_size:,} stored bytes, its trailer says {record.stored_bytes:,}")
        problem = record_problem(record, chain)
        if problem is not None:
            raise StoreError(problem)
        return record, chain, plain[:stored_size]

    def read_blob(self, blob_id: str) -> bytes:
        path = self.blob_path(blob_id)
        data = self._read_sealed(path, BLOB_LIMIT, "last-position logits")
        if self.blob_id(data) != blob_id:
            raise StoreError(f"{path}: last-position logits are damaged")
        return data
