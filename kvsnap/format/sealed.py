"""Sealed (encrypted) ``.kv`` snapshots, format version 2: the plain layout with every byte that says
anything about the session sealed with AES-256-GCM (``kvsnap.sealing``). No torch here.

    __metadata__["kvsnap"]           JSON in the clear: {"format_version": 2, "sealed": {"cipher",
                                     "key_id", "file_id"}}
    __metadata__["kvsnap_checksum"]  xxh3-64 of that JSON
    sealed_meta                      U8: the plain snapshot's metadata JSON (model, fingerprint, hash
                                     root, block hashes and checksums, chat messages), sealed
    tokens                           U8: the token ids (int32 LE), sealed
    block.000000 ...                 U8: each block's stored bytes, sealed
    last_logits                      U8: the float32 logits, sealed (optional)

A piece's associated data is the clear JSON (with its random ``file_id``) and the piece's name: a
piece moved to another name or another file, or any clear byte changed, fails authentication. In
the clear: the version, the cipher, the key's id, how many blocks there are and each piece's size
(the file's size says as much). A kvsnap that reads version 1 only refuses the file in one line
("format version 2 is newer than this kvsnap supports").
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from typing import Any

from kvsnap.errors import KvsnapError, SnapshotError, SnapshotKeyError
from kvsnap.format.meta import FORMAT_VERSION, SEALED_VERSION, header_json
from kvsnap.limits import MAX_HEADER_BYTES
from kvsnap.paths import open_regular
from kvsnap.sealing import KeyResolutionError, SealError, SealKey, resolve_key

CIPHER = "AES-256-GCM"
META_TENSOR = "sealed_meta"


@dataclass(frozen=True, slots=True)
class Sealing:
    """A sealed file's clear JSON and what it says."""

    text: str
    key_id: str
    file_id: str

    def aad(self, name: str) -> bytes:
        return self.text.encode() + b"\x00" + name.encode()


def new_sealing(key: SealKey) -> Sealing:
    """The clear part of a new sealed file: a fresh ``file_id`` binds its pieces to it alone."""
    file_id = os.urandom(16).hex()
    sealed = {"cipher": CIPHER, "key_id": key.key_id, "file_id": file_id}
    text = json.dumps({"format_version": SEALED_VERSION, "sealed": sealed}, separators=(",", ":"))
    return Sealing(text, key.key_id, file_id)


def sealing_of(header_meta: dict[str, str] | None) -> Sealing | None:
    """The sealing a safetensors header declares; None for a plain snapshot."""
    raw = header_json(header_meta)
    if raw["format_version"] == FORMAT_VERSION:
        return None
    sealed = raw.get("sealed")
    if (
        set(raw) != {"format_version", "sealed"}
        or not isinstance(sealed, dict)
        or sealed.get("cipher") != CIPHER
        or not re.fullmatch(r"[0-9a-f]{16}", str(sealed.get("key_id")))
        or not re.fullmatch(r"[0-9a-f]{32}", str(sealed.get("file_id")))
    ):
        raise SnapshotError("the clear metadata of an encrypted snapshot is malformed")
    assert header_meta is not None
    return Sealing(header_meta["kvsnap"], sealed["key_id"], sealed["file_id"])


def key_for(sealing: Sealing, key: SealKey | None) -> SealKey:
    """``key``, else ``$KVSNAP_KEY_FILE``'s, if it is the one the file was sealed with."""
    try:
        return resolve_key(sealing.key_id, key, what="encrypted", other_key="with another key")
    except KeyResolutionError as exc:
        raise SnapshotKeyError(str(exc)) from None


def open_piece(key: SealKey, sealing: Sealing, name: str, data: bytes | memoryview) -> bytes:
    try:
        return key.open(data, sealing.aad(name))
    except SealError:
        raise SnapshotError(f"{name} fails authentication: the file was changed or damaged") from None


def seal_piece(key: SealKey, sealing: Sealing, name: str, data: bytes | memoryview) -> bytes:
    return key.seal(data, sealing.aad(name))


def clear_facts(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What anyone may read of an encrypted snapshot without its key (``kvsnap inspect`` shows it):
    the format, cipher and key id, how many blocks, the file's size."""
    with open_regular(path, error=SnapshotError, what="snapshot") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        (length,) = struct.unpack("<Q", head) if len(head) == 8 else (size,)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise SnapshotError(f"{path}: not a kvsnap snapshot (truncated?)")
        try:
            header = json.loads(f.read(length))
        except (ValueError, RecursionError):
            raise SnapshotError(f"{path}: not a kvsnap snapshot (damaged header)") from None
    if not isinstance(header, dict):
        raise SnapshotError(f"{path}: not a kvsnap snapshot (damaged header)")
    try:
        sealing = sealing_of(header.get("__metadata__"))
    except SnapshotError as exc:
        raise type(exc)(f"{path}: {exc}") from None
    if sealing is None:
        raise SnapshotError(f"{path}: not an encrypted snapshot")
    blocks = sum(1 for name in header if name.startswith("block."))
    return {
        "file": str(path),
        "format_version": SEALED_VERSION,
        "encrypted": True,
        "cipher": CIPHER,
        "key_id": sealing.key_id,
        "blocks": blocks,
        "last_logits": "last_logits" in header,
        "file_bytes": size,
    }


def is_sealed(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is an encrypted snapshot (False for anything else, a missing file included)."""
    try:
        clear_facts(path)
    except (KvsnapError, OSError):
        return False
    return True
