"""Block codecs: raw KV bytes <-> stored bytes. No torch here.

``shuffle-zstd`` (the default) splits the float bytes into byte planes (all first bytes, all
second bytes, ...). The planes holding exponents compress well, the low mantissa planes hardly
at all, so each plane is zstd-compressed only when that makes it smaller and is stored as is
otherwise: most of the size win for a fraction of the decompression time. ``zstd`` and ``raw``
are kept for comparison. Every codec is lossless; decoding never produces more bytes than the
caller declares, and any inconsistency raises ``CodecError``.
"""

from __future__ import annotations

import struct
import threading

import numpy as np
import zstandard as zstd

# The codec names are settings (kvsnap.config); this module implements them and re-exports them.
from kvsnap.config import ALL_CODECS as ALL_CODECS
from kvsnap.config import CODECS as CODECS
from kvsnap.config import DEFAULT_CODEC, DEFAULT_LEVEL
from kvsnap.config import LOSSY_CODECS as LOSSY_CODECS

# Opt-in, lossy, never the default: int8 with one float32 scale per group of 64 values, then zstd.
INT8_GROUP = 64

_PLANE_RAW = 0
_PLANE_ZSTD = 1
_PLANE_HEADER = struct.Struct("<BQ")
# A plane is stored compressed only if that saves at least 3%: the low mantissa planes of float KV
# shrink by under 1%, which is not worth their decompression time on every resume.
_WORTH = 0.97
# The most output a zstd frame can produce per byte: every block (at most 128 KiB of output) costs at
# least 4 bytes (3-byte header + 1 RLE byte). A declared size beyond this is a lie, refused before any
# buffer of that size is allocated (a 17-byte frame can otherwise claim a terabyte).
ZSTD_MAX_RATIO = 32768
_local = threading.local()


class CodecError(ValueError):
    """Stored bytes that do not decode to the declared size (damaged or hostile data)."""


def _compressor(level: int) -> zstd.ZstdCompressor:
    # zstd contexts are not thread-safe: one per thread and level.
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstd.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)
    return cache[level]


def _decompressor() -> zstd.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstd.ZstdDecompressor()
    return _local.decompressor


def _check_declared(data: bytes | memoryview, size: int) -> None:
    try:
        declared = zstd.frame_content_size(data)
    except zstd.ZstdError as exc:
        raise CodecError(f"bad zstd frame: {exc}") from None
    if declared != size:
        raise CodecError(f"zstd frame declares {declared} bytes, expected {size}")
    if size > len(data) * ZSTD_MAX_RATIO:
        raise CodecError(f"zstd frame of {len(data)} bytes cannot hold {size} bytes")


def _zstd_decode(data: bytes | memoryview, size: int) -> bytes:
    _check_declared(data, size)
    try:
        # Bytes after the frame are damage too, not something to skip.
        out = _decompressor().decompress(data, max_output_size=size, allow_extra_data=False)
    except zstd.ZstdError as exc:
        raise CodecError(f"zstd: {exc}") from None
    if len(out) != size:
        raise CodecError(f"zstd produced {len(out)} bytes, expected {size}")
    return out


def _zstd_plane(data: bytes | memoryview, size: int) -> np.ndarray:
    """``_zstd_decode`` into this thread's reusable plane buffer (valid until its next call here):
    a fresh output object per block costs an allocation and page faults every time."""
    _check_whole_frame(data, size)
    buf = getattr(_local, "plane", None)
    if buf is None or buf.size < size + 1:
        buf = _local.plane = np.empty(size + 1, dtype=np.uint8)
    view = memoryview(buf)[: size + 1]  # one byte more: a frame that decodes longer than declared shows
    got = 0
    try:
        with _decompressor().stream_reader(data) as reader:
            while got <= size and (k := reader.readinto(view[got:])):
                got += k
    except zstd.ZstdError as exc:
        raise CodecError(f"zstd: {exc}") from None
    _check_produced(got, size)
    return buf[:size]


def _check_whole_frame(data: bytes | memoryview, size: int) -> None:
    """One frame declaring ``size`` bytes, and nothing after it (checked before decoding a byte)."""
    _check_declared(data, size)
    end = _frame_end(memoryview(data).cast("B"))
    if end != len(data):
        raise CodecError(f"zstd: {len(data) - end} bytes after the frame")


def _check_produced(got: int, size: int) -> None:
    if got != size:
        raise CodecError(f"zstd produced {got if got <= size else 'more than ' + str(size)} bytes, expected {size}")


def encode(
    raw: bytes | memoryview,
    itemsize: int,
    codec: str = DEFAULT_CODEC,
    level: int = DEFAULT_LEVEL,
    dtype: str | None = None,
) -> bytes:
    """Encode ``raw`` (elements of ``itemsize`` bytes; ``dtype`` names them, needed by lossy codecs)."""
    if codec == "int8-zstd":
        return _compressor(level).compress(_int8_payload(raw, _float_dtype(dtype, itemsize)))
    if codec == "raw":
        return bytes(raw)
    if codec == "zstd":
        return _compressor(level).compress(raw)
    if codec == "shuffle-zstd":
        return _encode_shuffled(raw, itemsize, level)
    raise ValueError(f"unknown codec {codec!r}; known: {', '.join(CODECS)}")


def decode(
    stored: bytes | memoryview,
    raw_size: int,
    itemsize: int,
    codec: str,
    out: np.ndarray | None = None,
    dtype: str | None = None,
) -> bytes | bytearray | np.ndarray:
    """Decode ``stored`` back to exactly ``raw_size`` bytes, or raise ``CodecError``.

    With ``out`` (a writable uint8 array of at least ``raw_size`` bytes) the result is written
    there and ``out[:raw_size]`` returned, so a reader can reuse one buffer for many blocks.
    """
    if codec == "raw":
        if len(stored) != raw_size:
            raise CodecError(f"raw block holds {len(stored)} bytes, expected {raw_size}")
        if out is None:
            return bytes(stored)
        out[:raw_size] = np.frombuffer(stored, dtype=np.uint8)
        return out[:raw_size]
    if codec == "zstd":
        data = _zstd_decode(stored, raw_size)
        if out is None:
            return data
        out[:raw_size] = np.frombuffer(data, dtype=np.uint8)
        return out[:raw_size]
    if codec == "shuffle-zstd":
        return _decode_shuffled(stored, raw_size, itemsize, out)
    if codec == "int8-zstd":
        return _decode_int8(stored, raw_size, _float_dtype(dtype, itemsize), out)
    raise CodecError(f"unknown codec {codec!r}")


def decode_into(
    stored: bytes | memoryview, raw_size: int, itemsize: int, codec: str, dst: np.ndarray, dtype=None
) -> None:
    """Decode ``stored`` straight into ``dst``: a uint8 array, possibly strided (a block's slice of a
    larger KV buffer), whose C-order elements are the raw bytes in order and whose last axis is
    ``itemsize`` long. Saves the copy out of a scratch buffer; raises ``CodecError`` as ``decode`` does."""
    if dst.size != raw_size or dst.shape[-1] != itemsize:
        raise ValueError(f"target of {dst.size} bytes (last axis {dst.shape[-1]}) for a {raw_size}-byte block")
    if codec == "shuffle-zstd":
        _unshuffle(*_planes(stored, raw_size, itemsize), dst)
        return
    if codec == "raw":
        if len(stored) != raw_size:
            raise CodecError(f"raw block holds {len(stored)} bytes, expected {raw_size}")
        data = stored
    else:
        data = decode(stored, raw_size, itemsize, codec, dtype=dtype)
    dst[...] = np.frombuffer(data, dtype=np.uint8).reshape(dst.shape)


def _encode_shuffled(raw: bytes | memoryview, itemsize: int, level: int) -> bytes:
    data = np.frombuffer(raw, dtype=np.uint8)
    if data.size % itemsize:
        raise ValueError(f"{data.size} bytes is not a whole number of {itemsize}-byte elements")
    planes = np.ascontiguousarray(data.reshape(-1, itemsize).T)  # [itemsize, n]
    header = [struct.pack("<B", itemsize)]
    payloads = []
    for plane in planes:
        packed = _compressor(level).compress(plane.data)
        if len(packed) < _WORTH * plane.size:
            header.append(_PLANE_HEADER.pack(_PLANE_ZSTD, len(packed)))
            payloads.append(packed)
        else:
            header.append(_PLANE_HEADER.pack(_PLANE_RAW, plane.size))
            payloads.append(plane.tobytes())
    return b"".join(header + payloads)


def max_decoded_size(codec: str, stored_size: int) -> int:
    """The most raw bytes ``stored_size`` stored bytes can decode to with ``codec`` (a sound bound)."""
    if codec == "raw":
        return stored_size
    # int8 turns each decompressed byte back into at most 4 (float32).
    return stored_size * ZSTD_MAX_RATIO * (4 if codec == "int8-zstd" else 1)


# -- int8 (lossy) ----------------------------------------------------------------------------

_FLOAT_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def _float_dtype(dtype: str | None, itemsize: int) -> str:
    if dtype is None:
        if itemsize != 4:
            raise CodecError("the int8 codec needs the dtype of 2-byte values (float16 or bfloat16)")
        dtype = "float32"
    if _FLOAT_ITEMSIZE.get(dtype) != itemsize:
        raise CodecError(f"dtype {dtype!r} does not have {itemsize}-byte elements")
    return dtype


def _to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return raw.view("<f4")
    if dtype == "float16":
        return raw.view("<f2").astype(np.float32)
    return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)  # bfloat16: the high half of a float32


def _from_float32(values: np.ndarray, dtype: str, out: np.ndarray) -> None:
    if dtype == "float32":
        out.view("<f4")[:] = values
    elif dtype == "float16":
        out.view("<f2")[:] = values
    else:  # bfloat16, rounded to nearest even
        bits = values.astype(np.float32).view(np.uint32)
        out.view("<u2")[:] = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _int8_payload(raw: bytes | memoryview, dtype: str) -> bytes:
    values = np.nan_to_num(_to_float32(np.frombuffer(raw, dtype=np.uint8), dtype), posinf=0.0, neginf=0.0)
    n = values.size
    groups = -(-n // INT8_GROUP)
    padded = np.zeros(groups * INT8_GROUP, dtype=np.float32)
    padded[:n] = values
    grid = padded.reshape(groups, INT8_GROUP)
    scale = np.abs(grid).max(axis=1) / 127.0
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(grid / scale[:, None]), -127, 127).astype(np.int8).reshape(-1)[:n]
    return scale.astype("<f4").tobytes() + q.tobytes()


def _decode_int8(stored: bytes | memoryview, raw_size: int, dtype: str, out: np.ndarray | None) -> bytes | np.ndarray:
    itemsize = _FLOAT_ITEMSIZE[dtype]
    if raw_size % itemsize:
        raise CodecError(f"declared size {raw_size} is not a multiple of {itemsize}")
    n = raw_size // itemsize
    groups = -(-n // INT8_GROUP)
    payload = _zstd_decode(stored, groups * 4 + n)
    scale = np.frombuffer(payload, dtype="<f4", count=groups)
    q = np.zeros(groups * INT8_GROUP, dtype=np.float32)
    q[:n] = np.frombuffer(payload, dtype=np.int8, offset=groups * 4)
    values = (q.reshape(groups, INT8_GROUP) * scale[:, None]).reshape(-1)[:n]
    target = np.empty(raw_size, dtype=np.uint8) if out is None else out[:raw_size]
    _from_float32(values, dtype, target)
    return target.tobytes() if out is None else target


def _decode_shuffled(
    stored: bytes | memoryview, raw_size: int, itemsize: int, out: np.ndarray | None = None
) -> bytearray | np.ndarray:
    n, planes = _planes(stored, raw_size, itemsize)
    result: bytearray | np.ndarray
    if out is None:
        result = bytearray(raw_size)
        flat = np.frombuffer(result, dtype=np.uint8)
    else:
        result = flat = out[:raw_size]
    _unshuffle(n, planes, flat.reshape(n, itemsize))
    return result


def _unshuffle(n: int, planes: list[tuple[int, memoryview]], dst: np.ndarray) -> None:
    """Byte plane ``i`` (``n`` bytes) into ``dst[..., i]``: ``dst`` holds the ``n`` elements, last axis their bytes."""
    for i, (mode, payload) in enumerate(planes):
        plane = np.frombuffer(payload, dtype=np.uint8) if mode == _PLANE_RAW else _zstd_plane(payload, n)
        dst[..., i] = plane.reshape(dst.shape[:-1])


def _planes(stored: bytes | memoryview, raw_size: int, itemsize: int) -> tuple[int, list[tuple[int, memoryview]]]:
    """The elements per plane and each plane's (mode, stored bytes), every header checked."""
    view = memoryview(stored).cast("B")
    if raw_size % itemsize:
        raise CodecError(f"declared size {raw_size} is not a multiple of {itemsize}")
    if len(view) < 1 or view[0] != itemsize:
        raise CodecError("byte-plane header does not match the element size")
    n = raw_size // itemsize
    pos = 1 + itemsize * _PLANE_HEADER.size
    if len(view) < pos:
        raise CodecError("byte-plane header is truncated")
    # Check every plane's header before the output is allocated: the declared size alone must not
    # make a damaged block allocate (and zero) gigabytes.
    planes = []
    for i in range(itemsize):
        mode, length = _PLANE_HEADER.unpack_from(view, 1 + i * _PLANE_HEADER.size)
        if length > len(view) - pos:
            raise CodecError(f"byte plane {i} runs past the end of the block")
        if mode == _PLANE_RAW:
            if length != n:
                raise CodecError(f"raw byte plane {i} holds {length} bytes, expected {n}")
        elif mode == _PLANE_ZSTD:
            if n > length * ZSTD_MAX_RATIO:
                raise CodecError(f"byte plane {i} of {length} bytes cannot hold {n} bytes")
        else:
            raise CodecError(f"byte plane {i} has unknown mode {mode}")
        planes.append((mode, view[pos : pos + length]))
        pos += length
    if pos != len(view):
        raise CodecError(f"{len(view) - pos} trailing bytes after the byte planes")
    return n, planes


# -- checking without decoding (verify) --------------------------------------------------------

# A block may declare up to a gigabyte that a few kilobytes of zstd decode to: checking one streams
# its frames through a buffer of this size and keeps nothing, so its memory does not grow with it.
_CHECK_CHUNK = 1 << 20


def check(stored: bytes | memoryview, raw_size: int, itemsize: int, codec: str, dtype: str | None = None) -> None:
    """Raise ``CodecError`` exactly when ``decode`` would, without building the decoded bytes."""
    if codec == "raw":
        if len(stored) != raw_size:
            raise CodecError(f"raw block holds {len(stored)} bytes, expected {raw_size}")
    elif codec == "zstd":
        _zstd_check(stored, raw_size)
    elif codec == "shuffle-zstd":
        n, planes = _planes(stored, raw_size, itemsize)
        for mode, payload in planes:
            if mode == _PLANE_ZSTD:
                _zstd_check(payload, n)
    elif codec == "int8-zstd":
        size = _FLOAT_ITEMSIZE[_float_dtype(dtype, itemsize)]
        if raw_size % size:
            raise CodecError(f"declared size {raw_size} is not a multiple of {size}")
        n = raw_size // size
        _zstd_check(stored, -(-n // INT8_GROUP) * 4 + n)
    else:
        raise CodecError(f"unknown codec {codec!r}")


def _zstd_check(data: bytes | memoryview, size: int) -> None:
    _check_whole_frame(data, size)
    buf = bytearray(max(1, min(size, _CHECK_CHUNK)))
    got = 0
    try:
        with _decompressor().stream_reader(data) as reader:
            while got <= size and (k := reader.readinto(buf)):
                got += k
    except zstd.ZstdError as exc:
        raise CodecError(f"zstd: {exc}") from None
    _check_produced(got, size)


def _frame_end(view: memoryview) -> int:
    """Where the zstd frame at the start of ``view`` ends, from its block headers (RFC 8878 3.1.1)."""
    try:
        pos = zstd.frame_header_size(view)
        has_checksum = zstd.get_frame_parameters(view).has_checksum
    except zstd.ZstdError as exc:
        raise CodecError(f"bad zstd frame: {exc}") from None
    while True:
        if pos + 3 > len(view):
            raise CodecError("zstd frame is truncated")
        header = view[pos] | view[pos + 1] << 8 | view[pos + 2] << 16
        kind = (header >> 1) & 3
        if kind == 3:
            raise CodecError("zstd frame holds a block of the reserved type")
        pos += 3 + (1 if kind == 1 else header >> 3)  # an RLE block stores one byte
        if header & 1:  # the last block
            break
    return pos + 4 * has_checksum
