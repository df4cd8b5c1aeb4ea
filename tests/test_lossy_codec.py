"""The opt-in lossy int8 codec: bounded error, named in the file, never the default."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsnap.engine.session import Session
from kvsnap.errors import ConfigError
from kvsnap.format import Snapshot, codec
from kvsnap.format.codec import CodecError
from kvsnap.store import BlockStore

TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _raw(dtype: str, n: int = 64 * 30 + 7, seed: int = 0) -> tuple[bytes, torch.Tensor]:
    values = torch.from_numpy(np.random.default_rng(seed).standard_normal(n).astype(np.float32) * 0.7)
    t = values.to(TORCH[dtype])
    return t.view(torch.uint8).numpy().tobytes(), t.float()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_int8_round_trip_error_is_within_half_a_step_of_each_group(dtype):
    raw, values = _raw(dtype)
    itemsize = codec._FLOAT_ITEMSIZE[dtype]
    stored = codec.encode(raw, itemsize, "int8-zstd", dtype=dtype)
    assert len(stored) < (1.1 / itemsize + 0.05) * len(raw)  # one byte a value plus a scale per 64
    back = codec.decode(stored, len(raw), itemsize, "int8-zstd", dtype=dtype)
    decoded = torch.frombuffer(bytearray(back), dtype=TORCH[dtype]).float()
    groups = values.numel() // 64
    g = values[: groups * 64].view(groups, 64)
    step = g.abs().max(dim=1).values / 127
    err = (decoded[: groups * 64].view(groups, 64) - g).abs()
    slack = {"float32": 1e-6, "float16": 2e-3, "bfloat16": 1e-2}[dtype]  # the output dtype's own rounding
    assert (err <= step[:, None] / 2 + slack * g.abs().max(dim=1).values[:, None] + 1e-7).all()
    assert not torch.equal(decoded, values)  # it is lossy
    out = np.empty(len(raw) + 10, dtype=np.uint8)
    assert bytes(codec.decode(stored, len(raw), itemsize, "int8-zstd", out=out, dtype=dtype)) == bytes(back)


def test_int8_refuses_what_it_cannot_decode_exactly():
    raw, _ = _raw("float32")
    stored = codec.encode(raw, 4, "int8-zstd")
    with pytest.raises(CodecError):
        codec.decode(stored, len(raw) + 4, 4, "int8-zstd")  # another declared size
    with pytest.raises(CodecError):
        codec.decode(stored[:-3], len(raw), 4, "int8-zstd")
    with pytest.raises(CodecError, match="dtype"):
        codec.encode(_raw("float16")[0], 2, "int8-zstd")  # 2-byte values need their dtype named
    assert "int8-zstd" not in codec.CODECS and codec.DEFAULT_CODEC in codec.CODECS


def test_int8_snapshot_restores_close_and_names_its_codec(llama, tmp_path):
    prompt = list(range(3, 90))
    exact = Session(llama, block_size=16)
    exact.prefill(prompt)
    exact_file = exact.save(tmp_path / "exact.kv")
    lossy = Session(llama, block_size=16, codec="int8-zstd")
    lossy.prefill(prompt)
    small = lossy.save(tmp_path / "int8.kv")
    assert small.file_bytes < 0.45 * exact_file.file_bytes
    with Snapshot(tmp_path / "int8.kv") as snap:
        assert snap.meta.codec == "int8-zstd" and not snap.verify()
    restored = Session(llama, block_size=16)
    restored.restore(tmp_path / "int8.kv", prompt + [5])
    for a, b in zip(restored.cache.layers, exact.cache.layers):
        scale = b.keys.abs().max()
        assert (a.keys - b.keys).abs().max() <= scale / 127
    with pytest.raises(ConfigError, match="lossy"):
        Session(llama, codec="int8-zstd", store=BlockStore(tmp_path / "store"))
