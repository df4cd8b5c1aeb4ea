"""Reading a ``.kv`` snapshot (see ``writer`` for the layout): metadata and tokens checked on open,
blocks read lazily. No torch here.

``Snapshot.read_into`` touches only the blocks asked for, checks each block's checksum, and decodes
them in parallel threads straight into the caller's buffers. Every way the file can be wrong ends
in ``SnapshotError`` with a one-line message.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from safetensors import safe_open

from kvsnap import hashing, quantization
from kvsnap.errors import ForeignSnapshotError, SnapshotError, one_line
from kvsnap.format import codec as codecs
from kvsnap.format import sealed
from kvsnap.format.meta import meta_from_text, parse_meta
from kvsnap.format.pool import DECODE_WORKERS, Scratch, map_in_order
from kvsnap.format.writer import block_name
from kvsnap.hashing import checksum
from kvsnap.paths import open_regular
from kvsnap.sealing import OVERHEAD, SealKey
from kvsnap.types import EncodedBlock, KVLayout

# ---------------------------------------------------------------------------------------------
# Reading


class Snapshot:
    """An open ``.kv`` file. Metadata and tokens are read and checked on open; blocks on demand.

    Use as a context manager, or call ``close()``.
    """

    def __init__(self, path: str | os.PathLike[str], key: SealKey | None = None):
        """``key`` opens an encrypted snapshot (default: ``$KVSNAP_KEY_FILE``'s, read only for one)."""
        self.path = Path(path)
        self._file = None
        self.sealing: sealed.Sealing | None = None
        self._key: SealKey | None = None
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
                self.identity = _identity(st)  # the file mapped: a later stat of the path tells if it was replaced
                break
            self.close()
        else:
            raise SnapshotError(f"{self.path}: the file keeps changing while it is opened")
        try:
            header_meta = self._file.metadata()
            self.sealing = sealed.sealing_of(header_meta)
            if self.sealing is None:
                self.meta = parse_meta(header_meta)
            else:
                self._key = sealed.key_for(self.sealing, key)
                if sealed.META_TENSOR not in self._spans:
                    raise SnapshotError("its sealed metadata is missing")
                self.meta = meta_from_text(self._piece(sealed.META_TENSOR).decode("utf-8", "surrogatepass"))
            self._check_tensors()
            self.tokens = self._read_tokens()
        except SnapshotError as exc:
            self.close()
            # Keep the subclass (SnapshotVersionError, ...): callers tell the cases apart by type.
            raise type(exc)(f"{self.path}: {exc}") from None
        except Exception as exc:
            self.close()
            raise SnapshotError(f"{self.path}: damaged file ({one_line(exc)})") from None

    def _open_once(self) -> os.stat_result:
        """Map the file and validate it with safetensors; returns the mapped file's identity."""
        # Only a regular file: a FIFO would hang the open, a device never end the read.
        with open_regular(self.path, error=SnapshotError) as fh:
            try:
                st = os.fstat(fh.fileno())
                if st.st_size < 8:
                    raise SnapshotError(f"{self.path}: not a kvsnap snapshot (file is {st.st_size} bytes, truncated?)")
                self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            except SnapshotError:
                raise
            except (OSError, ValueError) as exc:
                raise SnapshotError(f"{self.path}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
            self.file_bytes = st.st_size
            _check_looks_like_safetensors(self.path, self._mm)
            try:
                # safetensors opens by name: give it the name of the file already open and checked,
                # so it cannot be handed another file (or a FIFO) renamed over the path meanwhile.
                self._file = safe_open(_name_of(fh.fileno(), self.path), framework="numpy")
            except Exception as exc:  # safetensors raises its own error types for every header problem
                self.close()
                raise SnapshotError(
                    f"{self.path}: not a valid safetensors file ({one_line(exc)}); truncated?"
                ) from None
        try:
            self._locate()
        except SnapshotError as exc:
            self.close()
            raise SnapshotError(f"{self.path}: {exc}") from None
        except Exception as exc:
            self.close()
            raise SnapshotError(f"{self.path}: damaged file ({one_line(exc)})") from None
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

    def _piece(self, name: str) -> memoryview | bytes:
        """A tensor's bytes: a view of the file, or (sealed) the authenticated plaintext."""
        if self.sealing is None or self._key is None:
            return self._view(name)
        return sealed.open_piece(self._key, self.sealing, name, self._view(name))

    def _opened(self, name: str) -> memoryview | bytes:
        """``_piece`` after the file is open: a refusal names the file."""
        try:
            return self._piece(name)
        except SnapshotError as exc:
            raise SnapshotError(f"{self.path}: {exc}") from None

    def _check_tensors(self) -> None:
        f = self._file
        expected: dict[str, tuple[str, list[int] | None]] = {"tokens": ("I32", [self.meta.num_tokens])}
        for b in self.meta.blocks:
            expected[block_name(b.index)] = ("U8", [b.stored_bytes])
        if self.meta.logits_checksum is not None:
            expected["last_logits"] = ("F32", None)
        if self.sealing is not None:
            # Each piece is its plaintext and the seal's nonce and tag, as bytes.
            expected = {
                name: ("U8", None if shape is None else [_nbytes(dtype, shape) + OVERHEAD])
                for name, (dtype, shape) in expected.items()
            }
            expected[sealed.META_TENSOR] = ("U8", None)
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
        raw = bytes(self._piece("tokens"))
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

    @property
    def key(self) -> SealKey | None:
        """The key an encrypted snapshot was opened with; None for a plain one."""
        return self._key

    def read_stored(self, index: int) -> memoryview | bytes:
        """The stored (encoded) bytes of block ``index``, checksum verified; a view of the file, no copy
        (sealed: the opened bytes)."""
        info = self.meta.blocks[index]
        stored = self._opened(block_name(index))
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

    def decode_block_into(self, index: int, stored: bytes | memoryview, dst: np.ndarray) -> None:
        info = self.meta.blocks[index]
        layout = self.meta.storage_layout
        try:
            codecs.decode_into(stored, info.raw_bytes, layout.itemsize, self.meta.codec, dst, layout.dtype)
        except codecs.CodecError as exc:
            raise SnapshotError(f"{self.path}: block {index} does not decode ({exc})") from None
        except MemoryError:
            raise SnapshotError(f"{self.path}: block {index} declares more bytes than fit in memory") from None

    def encoded_block(self, index: int, stored: bytes | memoryview) -> EncodedBlock:
        info = self.meta.blocks[index]
        origin = (self._mm, self.file_bytes) if isinstance(stored, memoryview) else None
        return EncodedBlock(info.num_tokens, info.hash, info.raw_bytes, stored, info.checksum, origin)

    def read_into(
        self,
        indices: Sequence[int],
        sink: Callable[[int, np.ndarray], None],
        *,
        workers: int = DECODE_WORKERS,
        target: Callable[[int], np.ndarray | None] | None = None,
        done: Callable[[int, bool], None] | None = None,
    ) -> list[memoryview]:
        """Decode the given blocks, each handed to ``sink(index, raw)`` in its worker thread; returns
        their stored bytes (views of the file, checksum verified), which a session keeps for its next save.

        ``raw`` is a scratch buffer reused afterwards: copy it out. Only these blocks' bytes are read.
        ``target(index)`` may instead give the place the block's bytes go (see ``codec.decode_into``):
        then it is decoded straight there, ``sink`` is not called for it, and ``done(index, ok)`` hears
        whether the decode succeeded (a staging slot must be given back either way).
        """
        scratch = Scratch()

        def one(index: int) -> memoryview:
            stored = self.read_stored(index)
            dst = target(index) if target is not None else None
            if dst is not None:
                try:
                    self.decode_block_into(index, stored, dst)
                except BaseException:
                    if done is not None:
                        done(index, False)
                    raise
                if done is not None:
                    done(index, True)
            else:
                sink(index, self.decode_block(index, stored, out=scratch.get(self.meta.blocks[index].raw_bytes)))
            return stored

        return map_in_order(one, indices, workers)

    def read_raw(
        self, indices: Sequence[int], *, workers: int = DECODE_WORKERS
    ) -> list[bytes | bytearray | np.ndarray]:
        """The raw (decoded) bytes of the given blocks, in order, each its own buffer."""
        return map_in_order(lambda i: self.decode_block(i, self.read_stored(i)), indices, workers)

    def last_logits(self) -> np.ndarray | None:
        if self.meta.logits_checksum is None:
            return None
        raw = self._opened("last_logits")
        if len(raw) % 4:
            raise SnapshotError(f"{self.path}: last-position logits have a partial element")
        data = np.frombuffer(raw, dtype="<f4").copy()
        if checksum(raw) != self.meta.logits_checksum:
            raise SnapshotError(f"{self.path}: last-position logits fail their checksum")
        return data

    def verify(self) -> list[str]:
        """Check every block's checksum and decoding; returns the problems found (empty when sound).

        Blocks are checked one at a time and their decoded bytes streamed, not kept: a few kilobytes
        of zstd may declare a gigabyte, and checking them must not allocate it.
        """
        problems = []
        layout = self.meta.storage_layout
        for b in self.meta.blocks:
            try:
                codecs.check(self.read_stored(b.index), b.raw_bytes, layout.itemsize, self.meta.codec, layout.dtype)
            except SnapshotError as exc:
                problems.append(str(exc))
            except codecs.CodecError as exc:
                problems.append(f"{self.path}: block {b.index} does not decode ({exc})")
        try:
            self.last_logits()
        except SnapshotError as exc:
            problems.append(str(exc))
        return problems

    def check_compatible(
        self, *, model: str, fingerprint: str, root: bytes, layout: KVLayout, fingerprint_parts: dict | None = None
    ) -> None:
        """Refuse a snapshot written for another model, dtype or namespace, saying which differs."""
        m = self.meta
        ours = fingerprint_parts or {}
        # A float model records no quantization part: absent is "none".
        theirs_q, ours_q = m.fingerprint_parts.get("quantization", "none"), ours.get("quantization", "none")
        quantized_otherwise = bool(ours) and theirs_q != ours_q
        if m.layout != layout:
            # A quantized model keeps another KV dtype than its float one: the quantization is what differs.
            why = f": {quantization.refusal(theirs_q, ours_q)}" if quantized_otherwise else ""
            raise ForeignSnapshotError(
                f"{self.path}: written for {m.model} (cache of {m.layout.describe()}), "
                f"not for {model} (cache of {layout.describe()}){why}"
            )
        if m.fingerprint != fingerprint:
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
            if quantized_otherwise:
                differ.append("quantization")
                what["quantization"] = quantization.refusal(theirs_q, ours_q)
            why = f"different {', '.join(what[k] for k in differ)}; " if differ else ""
            raise ForeignSnapshotError(
                f"{self.path}: written for another model ({why}{m.model}, fingerprint {m.fingerprint[:12]}; "
                f"this is {model}, {fingerprint[:12]})"
            )
        if m.root != root:
            raise ForeignSnapshotError(f"{self.path}: written with another namespace or block size ({m.block_size})")


def _nbytes(dtype: str, shape: list[int]) -> int:
    n = {"I32": 4, "F32": 4, "U8": 1}[dtype]
    for dim in shape:
        n *= dim
    return n


def _name_of(fd: int, path: Path) -> str:
    """A name that opens the same file as ``fd``: /proc/self/fd/N where there is one, else the path."""
    proc = f"/proc/self/fd/{fd}"
    return proc if os.path.exists(proc) else str(path)


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _check_looks_like_safetensors(path: Path, mm: mmap.mmap) -> None:
    """Tell a file that is not a snapshot at all (a text file, a .gguf) from a damaged one, before
    safetensors says "header too large" about a text file's first eight bytes."""
    (header_len,) = struct.unpack_from("<Q", mm, 0)
    start = bytes(mm[8:9])
    if header_len <= len(mm) - 8 and start == b"{":
        return
    if header_len > len(mm) - 8 and start == b"{":
        raise SnapshotError(f"{path}: not a kvsnap snapshot: its header runs past the end of the file (truncated?)")
    # Never its bytes: the path may name anyone's file, and an error line may be shown or logged anywhere.
    raise SnapshotError(f"{path}: not a kvsnap snapshot (a .kv file is safetensors; this one is not)")
