"""Opt-in narrower KV storage (--kv-dtype): half the bytes, named in the file, restored by casting back."""

from __future__ import annotations

import pytest
import torch

from kvsnap.engine.session import Session
from kvsnap.errors import ConfigError
from kvsnap.format import Snapshot
from kvsnap.store import BlockStore


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
def test_narrow_storage_round_trips_within_its_precision(llama, tmp_path, kv_dtype):
    prompt = list(range(3, 90))
    full = Session(llama, block_size=16)
    full.prefill(prompt)
    lossless = full.save(tmp_path / "full.kv")
    narrow_session = Session(llama, block_size=16, kv_dtype=kv_dtype)
    narrow_session.prefill(prompt)
    narrow = narrow_session.save(tmp_path / "narrow.kv")
    assert narrow.file_bytes < 0.65 * lossless.file_bytes
    with Snapshot(tmp_path / "narrow.kv") as snap:
        assert snap.meta.storage_layout.dtype == kv_dtype and snap.meta.layout.dtype == "float32"

    restored = Session(llama, block_size=16)  # any session reads it; the cache is float32 again
    restored.restore(tmp_path / "narrow.kv", prompt + [5])
    tol = {"bfloat16": 1e-2, "float16": 1e-3}[kv_dtype]
    for a, b in zip(restored.cache.layers, full.cache.layers):
        assert a.keys.dtype == torch.float32
        assert torch.allclose(a.keys, b.keys, rtol=tol, atol=tol) and torch.allclose(
            a.values, b.values, rtol=tol, atol=tol
        )
        assert not torch.equal(a.keys, b.keys)  # it really was stored narrower


def test_narrow_blocks_are_reused_only_by_a_session_storing_the_same_width(llama, tmp_path):
    prompt = list(range(3, 90))
    s = Session(llama, block_size=16, kv_dtype="bfloat16")
    s.prefill(prompt)
    s.save(tmp_path / "a.kv")
    same = Session(llama, block_size=16, kv_dtype="bfloat16")
    same.restore(tmp_path / "a.kv")
    assert same.save(tmp_path / "b.kv").blocks_encoded == 1  # only the partial tail
    wide = Session(llama, block_size=16)
    wide.restore(tmp_path / "a.kv")
    assert wide.save(tmp_path / "c.kv").blocks_encoded == wide.save(tmp_path / "c.kv").blocks  # re-encoded


def test_narrow_storage_is_refused_with_a_store_and_for_unknown_dtypes(llama, tmp_path):
    with pytest.raises(ConfigError, match="block store"):
        Session(llama, kv_dtype="bfloat16", store=BlockStore(tmp_path / "s"))
    with pytest.raises(ConfigError, match="unknown"):
        Session(llama, kv_dtype="int4")
