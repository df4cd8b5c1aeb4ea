"""Block codecs: lossless for every KV dtype, bounded and strict when decoding damaged bytes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from kvsnap.format import codec
from kvsnap.format.codec import CODECS, CodecError


def _kv_float32(n: int = 4096, seed: int = 0) -> bytes:
    return (np.random.default_rng(seed).standard_normal(n) * 0.5).astype(np.float32).tobytes()


def _kv_float16(n: int = 4096, seed: int = 0) -> bytes:
    return (np.random.default_rng(seed).standard_normal(n) * 0.5).astype(np.float16).tobytes()


def _kv_bfloat16(n: int = 4096, seed: int = 0) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    values = (torch.randn(n, generator=gen) * 0.5).to(torch.bfloat16)
    return values.view(torch.int16).numpy().tobytes()


def _bit_patterns(itemsize: int, n: int = 4096, seed: int = 0) -> bytes:
    """Every kind of bit pattern: NaN payloads, infinities, subnormals, negative zero."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, n * itemsize, dtype=np.uint8)
    special = {
        4: np.array([0x7FC00001, 0xFF800000, 0x7F800000, 0x80000000, 0x00000001, 0x7FFFFFFF], dtype="<u4"),
        2: np.array([0x7FC1, 0xFF80, 0x7C00, 0x8000, 0x0001, 0x7FFF, 0xFC01], dtype="<u2"),
    }[itemsize].view(np.uint8)
    data[: special.size] = special
    return data.tobytes()


SAMPLES = {
    "float32": (_kv_float32(), 4),
    "float16": (_kv_float16(), 2),
    "bfloat16": (_kv_bfloat16(), 2),
    "float32-bits": (_bit_patterns(4), 4),
    "16bit-bits": (_bit_patterns(2), 2),
    "float32-zeros": (bytes(4096), 4),
    "one-element": (_kv_float32(1), 4),
    "empty": (b"", 4),
}


@pytest.mark.parametrize("name", SAMPLES)
@pytest.mark.parametrize("codec_name", CODECS)
def test_round_trip_is_bit_exact(codec_name, name):
    raw, itemsize = SAMPLES[name]
    stored = codec.encode(raw, itemsize, codec_name)
    out = codec.decode(stored, len(raw), itemsize, codec_name)
    assert bytes(out) == raw


@pytest.mark.parametrize("codec_name", CODECS)
def test_encode_accepts_a_memoryview(codec_name):
    raw = _kv_float32()
    assert codec.encode(memoryview(raw), 4, codec_name) == codec.encode(raw, 4, codec_name)


@pytest.mark.parametrize("level", [-5, 1, 3, 9])
def test_round_trip_at_other_levels(level):
    raw = _kv_bfloat16()
    for codec_name in CODECS:
        assert bytes(codec.decode(codec.encode(raw, 2, codec_name, level), len(raw), 2, codec_name)) == raw


def test_shuffle_zstd_stores_incompressible_planes_as_is():
    """A plane zstd cannot shrink is stored raw: random data costs exactly the byte-plane header."""
    raw = np.random.default_rng(4).integers(0, 256, 4 * 4096, dtype=np.uint8).tobytes()
    stored = codec.encode(raw, 4, "shuffle-zstd")
    assert len(stored) == len(raw) + 1 + 4 * 9  # element size, then (mode u8, length u64) per plane


def test_default_codec_is_lossless_shuffle_zstd():
    assert codec.DEFAULT_CODEC == "shuffle-zstd"
    assert codec.DEFAULT_CODEC in CODECS


def test_shuffle_zstd_is_smaller_than_zstd_on_kv_like_float32():
    raw = _kv_float32(64 * 1024)
    shuffled = len(codec.encode(raw, 4, "shuffle-zstd"))
    plain = len(codec.encode(raw, 4, "zstd"))
    assert shuffled < plain < len(raw) * 1.01
    assert shuffled < 0.9 * len(raw)  # the exponent plane compresses; measured ~0.83x on real KV


def test_shuffle_zstd_compresses_bfloat16():
    raw = _kv_bfloat16(64 * 1024)
    assert len(codec.encode(raw, 2, "shuffle-zstd")) < 0.85 * len(raw)


@pytest.mark.parametrize("codec_name", CODECS)
def test_incompressible_data_grows_by_a_small_header_only(codec_name):
    """The reader refuses blocks stored larger than raw + 4096 bytes: the writer must never make one."""
    raw = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    stored = codec.encode(raw, 4, codec_name)
    assert len(stored) <= len(raw) + 4096
    assert bytes(codec.decode(stored, len(raw), 4, codec_name)) == raw


# ---------------------------------------------------------------------------------------------
# Decoding what was not encoded that way


@pytest.mark.parametrize("codec_name", CODECS)
@pytest.mark.parametrize("delta", [-4, -1, 1, 4, 4096])
def test_wrong_declared_size_raises(codec_name, delta):
    raw = _kv_float32(256)
    stored = codec.encode(raw, 4, codec_name)
    with pytest.raises(CodecError):
        codec.decode(stored, len(raw) + delta, 4, codec_name)


def test_shuffle_zstd_refuses_a_size_that_is_not_whole_elements():
    raw = _kv_float32(256)
    with pytest.raises(CodecError):
        codec.decode(codec.encode(raw, 4, "shuffle-zstd"), len(raw) - 2, 4, "shuffle-zstd")


def test_shuffle_zstd_refuses_a_wrong_element_size():
    raw = _kv_float32(256)
    with pytest.raises(CodecError):
        codec.decode(codec.encode(raw, 4, "shuffle-zstd"), len(raw), 2, "shuffle-zstd")


@pytest.mark.parametrize("codec_name", CODECS)
def test_every_truncation_raises(codec_name):
    raw = _kv_float32(200)
    stored = codec.encode(raw, 4, codec_name)
    for cut in range(len(stored)):
        with pytest.raises(CodecError):
            codec.decode(stored[:cut], len(raw), 4, codec_name)


@pytest.mark.parametrize("codec_name", CODECS)
def test_trailing_bytes_raise(codec_name):
    """Guards zstd silently skipping bytes after its frame: extra bytes are damage, not padding."""
    raw = _kv_float32(200)
    stored = codec.encode(raw, 4, codec_name)
    for tail in (b"\x00", b"garbage", stored):
        with pytest.raises(CodecError):
            codec.decode(stored + tail, len(raw), 4, codec_name)


@pytest.mark.parametrize("codec_name", ["zstd", "shuffle-zstd"])
def test_garbage_raises(codec_name):
    rng = np.random.default_rng(5)
    for size in (0, 1, 7, 37, 1000):
        garbage = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        with pytest.raises(CodecError):
            codec.decode(garbage, 800, 4, codec_name)
    # Garbage behind a plausible byte-plane header.
    with pytest.raises(CodecError):
        codec.decode(b"\x04" + rng.integers(0, 256, 200, dtype=np.uint8).tobytes(), 800, 4, codec_name)


def test_shuffle_zstd_plane_length_past_the_end_raises():
    raw = _kv_float32(200)
    stored = bytearray(codec.encode(raw, 4, "shuffle-zstd"))
    stored[2:10] = (2**63).to_bytes(8, "little")  # plane 0's length: absurd
    with pytest.raises(CodecError):
        codec.decode(bytes(stored), len(raw), 4, "shuffle-zstd")


def test_zstd_frame_declaring_a_huge_size_is_refused_before_decompressing():
    """A frame that claims gigabytes must not be allowed to allocate them."""
    bomb = codec.encode(bytes(64 << 20), 4, "zstd", 1)  # tiny frame, 64 MiB of zeros
    assert len(bomb) < 64 << 10
    with pytest.raises(CodecError, match="declares"):
        codec.decode(bomb, 1024, 4, "zstd")


@pytest.mark.parametrize("codec_name", CODECS)
def test_random_damage_never_yields_another_size_or_another_error(codec_name):
    """Any damaged input decodes to exactly the declared size or raises CodecError, nothing else."""
    raw = _kv_float32(300)
    stored = codec.encode(raw, 4, codec_name)
    rng = np.random.default_rng(9)
    for _ in range(300):
        damaged = bytearray(stored)
        for pos in rng.integers(0, len(damaged), rng.integers(1, 4)):
            damaged[pos] ^= int(rng.integers(1, 256))
        try:
            out = codec.decode(bytes(damaged), len(raw), 4, codec_name)
        except CodecError:
            continue
        assert len(out) == len(raw)


def test_unknown_codec():
    with pytest.raises(ValueError, match="unknown codec"):
        codec.encode(b"1234", 4, "lz4")
    with pytest.raises(CodecError, match="unknown codec"):
        codec.decode(b"1234", 4, 4, "lz4")


def test_shuffle_zstd_refuses_partial_elements_on_encode():
    with pytest.raises(ValueError):
        codec.encode(b"123456", 4, "shuffle-zstd")


def test_codecs_are_thread_safe():
    """zstd contexts are per thread: concurrent use must neither crash nor mix up outputs."""
    raws = [_kv_float32(8192, seed=s) for s in range(16)]

    def round_trip(raw: bytes) -> bytes:
        out = raw
        for codec_name in CODECS:
            out = bytes(codec.decode(codec.encode(out, 4, codec_name), len(raw), 4, codec_name))
        return out

    with ThreadPoolExecutor(max_workers=8) as pool:
        assert list(pool.map(round_trip, raws * 4)) == raws * 4
