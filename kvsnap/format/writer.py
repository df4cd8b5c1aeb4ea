"""Writing a ``.kv`` snapshot: encode blocks, lay out the safetensors bytes, replace the file atomically.

The file is a valid safetensors file::

    __metadata__["kvsnap"]           JSON: version, model identity, cache layout, codec, blocks (see meta)
    __metadata__["kvsnap_checksum"]  xxh3-64 of that JSON, so a damaged header is refused
    tokens                           int32 [num_tokens], all tokens the KV covers
    block.000000 ...                 uint8 [stored_bytes], one per block: the block's K and V for
                                     every layer, raw layout [layers, 2, kv_heads, tokens, head_dim],
                                     encoded by the codec named in the metadata
    last_logits                      float32 [vocab], optional: logits after the last token

Sealed with a key (``kvsnap.format.sealed``), the same pieces are sealed and the metadata moves
into a sealed piece of its own.

No torch here.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvsnap import hashing
from kvsnap.errors import KvsnapError, SaveError
from kvsnap.format import codec as codecs
from kvsnap.format import sealed
from kvsnap.format.atomic import atomic_write
from kvsnap.format.meta import SnapshotHeader, build_meta
from kvsnap.hashing import checksum
from kvsnap.limits import MAX_HEADER_BYTES
from kvsnap.paths import check_save_target, open_regular
from kvsnap.sealing import SealKey
from kvsnap.types import EncodedBlock


def block_name(index: int) -> str:
    return f"block.{index:06d}"


def encode_block(
    raw: bytes | memoryview,
    num_tokens: int,
    hash_: bytes | None,
    itemsize: int,
    codec: str = codecs.DEFAULT_CODEC,
    level: int = codecs.DEFAULT_LEVEL,
    dtype: str | None = None,
) -> EncodedBlock:
    stored = codecs.encode(raw, itemsize, codec, level, dtype)
    return EncodedBlock(num_tokens, hash_, len(raw), stored, checksum(stored))


def write_snapshot(
    path: str | os.PathLike[str],
    header: SnapshotHeader,
    tokens: Sequence[int],
    blocks: Sequence[EncodedBlock],
    *,
    last_logits: np.ndarray | None = None,
    messages: Sequence[dict[str, str]] | None = None,
    key: SealKey | None = None,
) -> int:
    """Write a snapshot atomically; returns the file size. With ``key`` the file is sealed
    (``kvsnap.format.sealed``: format version 2).

    The file is written to a temporary name in the same folder, flushed, fsynced and renamed
    over ``path``, then the folder is fsynced: a crash leaves either the old file or the new
    one, never half of one.
    """
    if sum(b.num_tokens for b in blocks) != len(tokens):
        raise ValueError("blocks do not cover the tokens")
    refuse_foreign(path, error=SaveError)
    token_data = hashing.token_bytes(tokens)
    logits_data = None
    if last_logits is not None:
        logits_data = np.ascontiguousarray(last_logits, dtype="<f4").reshape(-1).tobytes()
    meta_json = build_meta(
        header,
        tokens_checksum=checksum(token_data),
        num_tokens=len(tokens),
        blocks=blocks,
        logits_checksum=checksum(logits_data) if logits_data is not None else None,
        messages=messages,
    )
    clear = meta_json
    sealing = sealed.new_sealing(key) if key is not None else None
    if sealing is not None:
        clear = sealing.text
    tensors: dict[str, Any] = {"__metadata__": {"kvsnap": clear, "kvsnap_checksum": checksum(clear.encode())}}
    payloads: list[bytes | memoryview] = []
    offset = 0

    def add(name: str, dtype: str, shape: list[int], data: bytes | memoryview) -> None:
        nonlocal offset
        if key is not None and sealing is not None:
            data = sealed.seal_piece(key, sealing, name, data)
            dtype, shape = "U8", [len(data)]
        tensors[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        payloads.append(data)
        offset += len(data)

    if sealing is not None:
        add(sealed.META_TENSOR, "U8", [], meta_json.encode())
    add("tokens", "I32", [len(tokens)], token_data)
    for i, b in enumerate(blocks):
        add(block_name(i), "U8", [len(b.stored)], b.stored)
    if logits_data is not None:
        add("last_logits", "F32", [len(logits_data) // 4], logits_data)
    header_bytes = json.dumps(tensors, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # safetensors aligns the data to 8 bytes
    if len(header_bytes) > MAX_HEADER_BYTES:  # safetensors would refuse to open the file
        raise SaveError(
            f"cannot write the snapshot: its header would be {len(header_bytes):,} bytes, safetensors reads at most "
            f"{MAX_HEADER_BYTES:,} (too many blocks or too much chat text: use a larger block size)"
        )
    return atomic_write(Path(path), [struct.pack("<Q", len(header_bytes)), header_bytes, *payloads])


def check_snapshot_target(path: str | os.PathLike[str], *, error: type[KvsnapError], foreign: bool = True) -> None:
    """Refuse, with ``error`` and one line, a save target a snapshot could not replace or must not:
    ``paths.check_save_target``'s (a missing folder, a link, a special file), a folder this process
    cannot create a file in, and (``foreign``) an existing file that is not a kvsnap snapshot
    (someone's notes, a model's weights: a save replaces a snapshot only). Callers check before the
    work a save ends."""
    check_save_target(path, error=error)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        # A file made and removed at once, named as a save's temp file: permissions alone do not tell
        # (root, a read-only mount, /proc).
        fd, probe = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise error(f"{path}: cannot save there, cannot create a file in {folder} ({exc.strerror or exc})") from None
    if foreign:
        refuse_foreign(path, error=error)


def refuse_foreign(path: str | os.PathLike[str], *, error: type[KvsnapError]) -> None:
    """Refuse to replace an existing file that is not a kvsnap snapshot (every save checks)."""
    if os.path.lexists(path) and not _holds_a_snapshot(path, error):
        raise error(f"{path}: exists and is not a kvsnap snapshot; kvsnap replaces snapshots only (name another file)")


def _holds_a_snapshot(path: str | os.PathLike[str], error: type[KvsnapError]) -> bool:
    """Whether ``path``'s header is a kvsnap snapshot's (plain or sealed): safetensors whose metadata
    names kvsnap. Only the header is read."""
    with open_regular(path, error=error, what="file") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            return False
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER_BYTES, size - 8):
            return False
        try:
            header = json.loads(f.read(length))
        except (ValueError, RecursionError):
            return False
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return isinstance(meta, dict) and "kvsnap" in meta
