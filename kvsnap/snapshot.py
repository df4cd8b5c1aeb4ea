"""The ``.kv`` snapshot file: write (atomically), read lazily, verify. No torch here.

A ``.kv`` file is a valid safetensors file::

    __metadata__["kvsnap"]           JSON: version, model identity, cache layout, codec, blocks
    __metadata__["kvsnap_checksum"]  xxh3-64 of that JSON, so a damaged header is refused
    tokens                           int32 [num_tokens], all tokens the KV covers
    block.000000 ...                 uint8 [stored_bytes], one per block: the block's K and V for
                                     every layer, raw layout [layers, 2, kv_heads, tokens, head_dim],
                                     encoded by the codec named in the metadata
    last_logits                      float32 [vocab], optional: logits after the last token

Reading is lazy: ``Snapshot.read_blocks`` touches only the blocks asked for, checks each
block's checksum, and decodes them in parallel threads. Every way the file can be wrong ends in
``SnapshotError`` with a one-line message. The format's values and metadata parser live in
``snapshot_meta``, whole-or-nothing writes in ``atomic``; both are re-exported here.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from kvsnap import codec as codecs
from kvsnap import hashing
from kvsnap.atomic import atomic_write, fsync_dir, remove_stale_temps  # noqa: F401  (re-exported)
from kvsnap.errors import ForeignSnapshotError, SnapshotError
from kvsnap.snapshot_meta import (  # noqa: F401  (re-exported: the format's values live there)
    FORMAT_VERSION,
    KV_DTYPES,
    READABLE_VERSIONS,
    BlockInfo,
    EncodedBlock,
    KVLayout,
    SnapshotMeta,
    _one_line,
    _parse_meta,
    chat_messages,
    checksum,
)

_DECODE_WORKERS = max(1, min(8, os.cpu_count() or 1))


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


# ---------------------------------------------------------------------------------------------
# Writing


def write_snapshot(
    path: str | os.PathLike[str],
    *,
    model: str,
    fingerprint: str,
    root: bytes,
    layout: KVLayout,
    block_size: int,
    codec: str,
    level: int,
    tokens: Sequence[int],
    blocks: Sequence[EncodedBlock],
    last_logits: np.ndarray | None = None,
    messages: Sequence[dict[str, str]] | None = None,
    extra: dict[str, Any] | None = None,
    fingerprint_parts: dict[str, str] | None = None,
    storage_dtype: str | None = None,
) -> int:
    """Write a snapshot atomically; returns the file size.

    The file is written to a temporary name in the same folder, flushed, fsynced and renamed
    over ``path``, then the folder is fsynced: a crash leaves either the old file or the new
    one, never half of one.
    """
    if sum(b.num_tokens for b in blocks) != len(tokens):
        raise ValueError("blocks do not cover the tokens")
    token_data = hashing.token_bytes(tokens)
    logits_data = None
    if last_logits is not None:
        logits_data = np.ascontiguousarray(last_logits, dtype="<f4").reshape(-1).tobytes()
    meta = {
        "format_version": FORMAT_VERSION,
        "hash_scheme": hashing.HASH_SCHEME,
        "model": model,
        "fingerprint": fingerprint,
        "root": root.hex(),
        "layout": {
            "layers": layout.num_layers,
            "kv_heads": layout.num_kv_heads,
            "head_dim": layout.head_dim,
            "dtype": layout.dtype,
            "order": "layers,kv,kv_heads,tokens,head_dim",
        },
        "block_size": block_size,
        "codec": codec,
        "level": level,
        "num_tokens": len(tokens),
        "tokens_checksum": checksum(token_data),
        "blocks": [
            {
                "tokens": b.num_tokens,
                "hash": b.hash.hex() if b.hash is not None else None,
                "raw_bytes": b.raw_bytes,
                "stored_bytes": len(b.stored),
                "checksum": b.checksum,
            }
            for b in blocks
        ],
        "logits_checksum": checksum(logits_data) if logits_data is not None else None,
        "messages": list(messages) if messages is not None else None,
        "created_at": time.time(),
        "extra": extra or {},
    }
    if storage_dtype is not None and storage_dtype != layout.dtype:
        # Opt-in narrower storage of a float32 cache (lossy): blocks hold this dtype, restore casts back.
        if storage_dtype not in KV_DTYPES:
            raise ValueError(f"unknown storage dtype {storage_dtype!r}")
        meta["storage_dtype"] = storage_dtype
    if fingerprint_parts:
        # Config, tokenizer, weights and KV dtype digests: lets a refusal say which one differs.
        meta["fingerprint_parts"] = dict(fingerprint_parts)
    # ASCII JSON: chat text with lone surrogates (from odd terminals) still makes a valid file.
    meta_json = json.dumps(meta, separators=(",", ":"), ensure_ascii=True)
    header: dict[str, Any] = {"__metadata__": {"kvsnap": meta_json, "kvsnap_checksum": checksum(meta_json.encode())}}
    payloads: list[bytes | memoryview] = []
    offset = 0

    def add(name: str, dtype: str, shape: list[int], data: bytes | memoryview) -> None:
        nonlocal offset
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        payloads.append(data)
        offset += len(data)

    add("tokens", "I32", [len(tokens)], token_data)
    for i, b in enumerate(blocks):
        add(block_name(i), "U8", [len(b.stored)], b.stored)
    if logits_data is not None:
        add("last_logits", "F32", [len(logits_data) // 4], logits_data)
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # safetensors aligns the data to 8 bytes
    return atomic_write(Path(path), [struct.pack("<Q", len(header_bytes)), header_bytes, *payloads])


_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    """A decode pool kept for the process: starting threads anew cost ~1 ms each per restore."""
    with _pools_lock:
        pool = _pools.get(workers)
        if pool is None:
            pool = _pools[workers] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvsnap-decode")
        return pool


def _after_fork_in_child() -> None:
    # A forked child has none of the parent's threads: a pool inherited from it would never run a
    # task, and a lock some parent thread held would never be released.
    global _pools_lock
    _pools.clear()
    _pools_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _Scratch:
    """One reusable decode buffer per worker thread for one read (fresh pages for every block would
    cost page faults); dropped with the read, so idle pool threads hold no memory."""

    def __init__(self) -> None:
        self._bufs: dict[int, np.ndarray] = {}

    def get(self, size: int) -> np.ndarray:
        key = threading.get_ident()
        buf = self._bufs.get(key)
        if buf is None or buf.size < size:
            buf = self._bufs[key] = np.empty(size, dtype=np.uint8)
        return buf


def block_name(index: int) -> str:
    return f"block.{index:06d}"


# ---------------------------------------------------------------------------------------------
# Reading


class Snapshot:
    """An open ``.kv`` file. Metadata and tokens are read and checked on open; blocks on demand.

    Use as a context manager, or call ``close()``.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._file = None
        self._mm: mmap.mmap | None = None
        # A save may rename a new file over this path while we open it: the safetensors check and
        # the map must see the same file, so compare identities and retry if they differ.
        for _attempt in range(3):
            st = self._open_once()
            try:
                now = os.stat(self.path)
            except OSError:
                now = None
            if now is not None and _identity(now) == _identity(st):
                break
            self.close()
        else:
            raise SnapshotError(f"{self.path}: the file keeps changing while it is opened")
        try:
            self.meta = _parse_meta(self._file.metadata())
            self._check_tensors()
            self.tokens = self._read_tokens()
        except SnapshotError as exc:
            self.close()
            # Keep the subclass (SnapshotVersionError, ...): callers tell the cases apart by type.
            raise type(exc)(f"{self.path}: {exc}") from None
        except Exception as exc:
            self.close()
            raise SnapshotError(f"{self.path}: damaged file ({_one_line(exc)})") from None

    def _open_once(self) -> os.stat_result:
        """Map the file and validate it with safetensors; returns the mapped file's identity."""
        try:
            with open(self.path, "rb") as fh:
                st = os.fstat(fh.fileno())
                if st.st_size < 8:
                    raise SnapshotError(f"{self.path}: not a kvsnap snapshot (file is {st.st_size} bytes, truncated?)")
                self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise SnapshotError(f"{self.path}: no such file") from None
        except SnapshotError:
            raise
        except (OSError, ValueError) as exc:
            raise SnapshotError(f"{self.path}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
        self.file_bytes = st.st_size
        try:
            self._file = safe_open(str(self.path), framework="numpy")
        except Exception as exc:  # safetensors raises its own error types for every header problem
            self.close()
            raise SnapshotError(f"{self.path}: not a valid safetensors file ({_one_line(exc)}); truncated?") from None
        try:
            self._locate()
        except SnapshotError as exc:
            self.close()
            raise SnapshotError(f"{self.path}: {exc}") from None
        except Exception as exc:
            self.close()
            raise SnapshotError(f"{self.path}: damaged file ({_one_line(exc)})") from None
        return st

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._file = None
        if self._mm is not None:
            # Blocks handed out (a session keeps them for its next save) are views of the map;
            # it is unmapped when the last of them is dropped.
            with contextlib.suppress(BufferError):
                self._mm.close()
            self._mm = None

    def _locate(self) -> None:
        """Find every tensor's bytes in the map: blocks are then read without a copy."""
        size = len(self._mm)
        (header_len,) = struct.unpack_from("<Q", self._mm, 0)
        if header_len > size - 8:
            raise SnapshotError("header runs past the end of the file (truncated?)")
        header = json.loads(bytes(self._mm[8 : 8 + header_len]))
        if not isinstance(header, dict):
            raise SnapshotError("header is not a JSON object")
        start = 8 + header_len
        self._spans: dict[str, tuple[int, int]] = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            a, b = entry["data_offsets"]
            if not (isinstance(a, int) and isinstance(b, int) and 0 <= a <= b <= size - start):
                raise SnapshotError(f"tensor {name} lies outside the file")
            self._spans[name] = (start + a, start + b)

    def _view(self, name: str) -> memoryview:
        if self._mm is None:
            raise SnapshotError(f"{self.path}: snapshot is closed")
        a, b = self._spans[name]
        return memoryview(self._mm)[a:b]

    def _check_tensors(self) -> None:
        f = self._file
        expected = {"tokens": ("I32", [self.meta.num_tokens])}
        for b in self.meta.blocks:
            expected[block_name(b.index)] = ("U8", [b.stored_bytes])
        if self.meta.logits_checksum is not None:
            expected["last_logits"] = ("F32", None)
        names = set(f.keys())
        if names != set(expected):
            missing = sorted(set(expected) - names)
            extra = sorted(names - set(expected))
            raise SnapshotError(f"tensors do not match the metadata (missing {missing[:3]}, unexpected {extra[:3]})")
        for name, (dtype, shape) in expected.items():
            sl = f.get_slice(name)
            if sl.get_dtype() != dtype or (shape is not None and list(sl.get_shape()) != shape):
                raise SnapshotError(
                    f"tensor {name} has dtype {sl.get_dtype()} shape {sl.get_shape()}, expected {dtype} {shape}"
                )

    def _read_tokens(self) -> list[int]:
        raw = bytes(self._view("tokens"))
        if checksum(raw) != self.meta.tokens_checksum:
            raise SnapshotError("token ids fail their checksum")
        tokens = hashing.tokens_from_bytes(raw)
        # The stored hashes must be the chain of the stored tokens: a header edit cannot pass.
        expect = hashing.chain_hashes(tokens, self.meta.block_size, self.meta.root)
        if expect != self.meta.block_hashes:
            raise SnapshotError("block hashes do not match the token ids")
        return tokens

    @property
    def num_tokens(self) -> int:
        return self.meta.num_tokens

    def read_stored(self, index: int) -> memoryview:
        """The stored (encoded) bytes of block ``index``, checksum verified; a view of the file, no copy."""
        info = self.meta.blocks[index]
        stored = self._view(block_name(index))
        if len(stored) != info.stored_bytes or checksum(stored) != info.checksum:
            raise SnapshotError(f"{self.path}: checksum mismatch in block {index}")
        return stored

    def decode_block(
        self, index: int, stored: bytes | memoryview, out: np.ndarray | None = None
    ) -> bytes | bytearray | np.ndarray:
        info = self.meta.blocks[index]
        try:
            layout = self.meta.storage_layout
            return codecs.decode(stored, info.raw_bytes, layout.itemsize, self.meta.codec, out, layout.dtype)
        except codecs.CodecError as exc:
            raise SnapshotError(f"{self.path}: block {index} does not decode ({exc})") from None
        except MemoryError:
            raise SnapshotError(f"{self.path}: block {index} declares more bytes than fit in memory") from None

    def encoded_block(self, index: int, stored: bytes | memoryview) -> EncodedBlock:
        info = self.meta.blocks[index]
        origin = (self._mm, self.file_bytes) if isinstance(stored, memoryview) else None
        return EncodedBlock(info.num_tokens, info.hash, info.raw_bytes, stored, info.checksum, origin)

    def read_blocks(
        self,
        indices: Sequence[int],
        *,
        workers: int = _DECODE_WORKERS,
        keep_stored: bool = False,
        sink: Callable[[int, np.ndarray], None] | None = None,
    ) -> list[Any] | tuple[list[Any], list[memoryview]]:
        """Raw bytes of the given blocks, in order; only these blocks' bytes are read.

        Blocks are checksum-verified and decoded in parallel threads (zstd and numpy copies
        release the GIL). With ``sink``, each decoded block is handed to ``sink(index, raw)`` in
        its worker thread instead (``raw`` is a scratch buffer reused afterwards: copy it out) and
        the returned raws are None. With ``keep_stored`` also returns the stored bytes (views of
        the file), which a session keeps for its next save.
        """
        indices = list(indices)
        scratch = _Scratch()

        def one(index: int) -> tuple[Any, memoryview]:
            stored = self.read_stored(index)
            if sink is None:
                return self.decode_block(index, stored), stored
            raw = self.decode_block(index, stored, out=scratch.get(self.meta.blocks[index].raw_bytes))
            sink(index, raw)
            return None, stored

        if workers > 1 and len(indices) > 1:
            futures = [_pool(workers).submit(one, i) for i in indices]
            try:
                results = [f.result() for f in futures]
            except BaseException:
                # Nothing may still write into the caller's buffers once this returns (a failed
                # restore is followed by a recompute into other buffers): cancel what has not
                # started and wait for what has.
                for f in futures:
                    f.cancel()
                wait(futures)
                raise
        else:
            results = [one(i) for i in indices]
        raws = [r for r, _ in results]
        return (raws, [st for _, st in results]) if keep_stored else raws

    def last_logits(self) -> np.ndarray | None:
        if self.meta.logits_checksum is None:
            return None
        raw = self._view("last_logits")
        if len(raw) % 4:
            raise SnapshotError(f"{self.path}: last-position logits have a partial element")
        data = np.frombuffer(raw, dtype="<f4").copy()
        if checksum(raw) != self.meta.logits_checksum:
            raise SnapshotError(f"{self.path}: last-position logits fail their checksum")
        return data

    def verify(self) -> list[str]:
        """Check every block's checksum and decoding; returns the problems found (empty when sound)."""
        problems = []
        for b in self.meta.blocks:
            try:
                self.decode_block(b.index, self.read_stored(b.index))
            except SnapshotError as exc:
                problems.append(str(exc))
        try:
            self.last_logits()
        except SnapshotError as exc:
            problems.append(str(exc))
        return problems

    def check_compatible(
        self,
        *,
        model: str,
        fingerprint: str,
        root: bytes,
        layout: KVLayout,
        fingerprint_parts: dict[str, str] | None = None,
    ) -> None:
        """Refuse a snapshot written for another model, dtype or namespace, saying which differs."""
        m = self.meta
        if m.layout != layout:
            raise ForeignSnapshotError(
                f"{self.path}: written for a cache of {_layout_str(m.layout)}, this model has {_layout_str(layout)}"
            )
        if m.fingerprint != fingerprint:
            ours = fingerprint_parts or {}
            differ = [
                k
                for k in ("weights", "tokenizer", "config", "kv_dtype")
                if k in ours and k in m.fingerprint_parts and ours[k] != m.fingerprint_parts[k]
            ]
            what = {
                "weights": "weights",
                "tokenizer": "tokenizer",
                "config": "config (architecture, RoPE, ...)",
                "kv_dtype": "KV dtype",
            }
            why = f"different {', '.join(what[k] for k in differ)}; " if differ else ""
            raise ForeignSnapshotError(
                f"{self.path}: written for another model ({why}{m.model}, fingerprint {m.fingerprint[:12]}; "
                f"this is {model}, {fingerprint[:12]})"
            )
        if m.root != root:
            raise ForeignSnapshotError(f"{self.path}: written with another namespace or block size ({m.block_size})")


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _layout_str(layout: KVLayout) -> str:
    return f"{layout.num_layers} layers x {layout.num_kv_heads} kv heads x {layout.head_dim} ({layout.dtype})"
