"""The KV arena and straight-into-the-buffer decoding: resumes reuse mapped pages, never a live cache's.

What a user relies on: a second resume in the same process writes into the buffer the first one
let go (no fresh pages), a buffer a live cache still views is never handed to another, and the
bytes decoded straight into the buffer are the bytes a scratch decode gives.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsnap.config import SamplingParams
from kvsnap.engine import arena
from kvsnap.engine.session import Session
from kvsnap.format import codec
from kvsnap.format.codec import CODECS

GREEDY = SamplingParams(max_new_tokens=4, temperature=0)


@pytest.fixture(autouse=True)
def empty_arena():
    arena.clear()
    yield
    arena.clear()


def _ptr(session: Session) -> int:
    return session.cache.layers[0].keys.data_ptr()


def test_a_dropped_buffer_is_reused_and_a_viewed_one_never(llama, tmp_path):
    ids = list(range(5, 5 + 96))
    first = Session(llama, block_size=16)
    first.prefill(ids[:80])
    first.save(tmp_path / "a.kv")

    a = Session(llama, block_size=16)
    a.restore(tmp_path / "a.kv", ids)
    b = Session(llama, block_size=16)
    b.restore(tmp_path / "a.kv", ids)
    # Both alive: two buffers, whatever the pool holds.
    assert _ptr(a) != _ptr(b)
    kept = _ptr(a)
    del a
    c = Session(llama, block_size=16)
    c.restore(tmp_path / "a.kv", ids)
    assert _ptr(c) == kept, "the buffer of the dropped session was not reused"
    assert _ptr(c) != _ptr(b)
    # Reused pages hold the restored KV, not what the last user left there.
    assert c.run(ids, GREEDY).text == Session(llama, block_size=16).run(ids, GREEDY).text


def test_a_fresh_prefill_writes_into_the_buffer_it_reserved_and_never_regrows(llama):
    """Bug: a fresh cache dropped the buffer ``prefill`` reserved for the whole prompt at its first
    chunk (an empty view's data_ptr() is 0, so the reserved buffer looked foreign) and regrew its
    own per layer, doubling and copying its history chunk after chunk."""
    s = Session(llama, block_size=16, chunk_size=16)
    seen = []
    handle = llama.model.register_forward_hook(lambda *_: seen.append(_ptr(s)))
    try:
        s.prefill(list(range(5, 5 + 200)))
    finally:
        handle.remove()
    assert len(seen) == 13 and len(set(seen)) == 1  # 13 chunks, one buffer: never regrown
    storage = {layer.keys.untyped_storage().data_ptr() for layer in s.cache.layers}
    assert len(storage) == 1 and any(e.buf.untyped_storage().data_ptr() in storage for e in arena._pool)


def test_a_view_or_array_of_a_buffer_keeps_it_out_of_the_pool():
    buf = arena.kv_buffer(2, 3, 4, 10, torch.float32, "cpu")
    view = buf[1, 0]
    array = arena.kv_buffer(2, 3, 4, 10, torch.float32, "cpu").numpy()
    del buf
    again = arena.kv_buffer(2, 3, 4, 10, torch.float32, "cpu")
    assert again.data_ptr() not in (view.data_ptr() - view.storage_offset() * 4, array.ctypes.data)
    del view, array
    assert arena.pooled_bytes() == (3 * again.numel() * 4, 2 * again.numel() * 4)


def test_the_pool_lets_go_of_free_buffers_past_its_budget(monkeypatch):
    monkeypatch.setattr(arena, "MAX_POOLED_BYTES", 2 * 2 * 2 * 3 * 10 * 4 * 4)
    held = [arena.kv_buffer(2, 3, 4, 10, torch.float32, "cpu") for _ in range(2)]
    del held
    arena.kv_buffer(2, 3, 4, 40, torch.float32, "cpu")  # twice the size: both free ones go
    total, _ = arena.pooled_bytes()
    assert total == 2 * 2 * 3 * 40 * 4 * 4 // 2


def test_garbage_left_in_a_reused_buffer_never_reaches_an_answer(llama):
    ids = list(range(7, 7 + 70))
    clean = [Session(llama, block_size=16).run(ids[: 40 + i * 10], GREEDY).text for i in range(3)]
    layout = llama.layout
    for capacity in (64, 512, 2048):  # poison whatever the pool holds, at every size it may pick
        buf = arena.kv_buffer(layout.num_layers, layout.num_kv_heads, layout.head_dim, capacity, torch.float32, "cpu")
        buf.fill_(float("nan"))
        del buf
    assert arena.pooled_bytes()[1] > 0
    again = [Session(llama, block_size=16).run(ids[: 40 + i * 10], GREEDY).text for i in range(3)]
    assert again == clean


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("itemsize", [2, 4])
def test_decode_into_a_strided_slice_equals_decode(name, itemsize):
    rng = np.random.default_rng(1)
    L, H, T, D = 3, 2, 8, 4
    raw = (rng.standard_normal(L * 2 * H * T * D) * 0.3).astype(np.float32 if itemsize == 4 else np.float16).tobytes()
    stored = codec.encode(raw, itemsize, name)
    big = np.zeros((L, 2, H, 3 * T, D, itemsize), dtype=np.uint8)
    codec.decode_into(stored, len(raw), itemsize, name, big[:, :, :, T : 2 * T])
    expected = np.frombuffer(codec.decode(stored, len(raw), itemsize, name), dtype=np.uint8)
    assert np.array_equal(big[:, :, :, T : 2 * T].reshape(-1), expected)
    assert not big[:, :, :, :T].any() and not big[:, :, :, 2 * T :].any()


def test_decode_into_refuses_damage_like_decode():
    raw = np.arange(64, dtype=np.float32).tobytes()
    stored = bytearray(codec.encode(raw, 4, "shuffle-zstd"))
    stored[-3] ^= 0xFF
    with pytest.raises(codec.CodecError):
        codec.decode(bytes(stored), len(raw), 4, "shuffle-zstd")
    with pytest.raises(codec.CodecError):
        codec.decode_into(bytes(stored), len(raw), 4, "shuffle-zstd", np.zeros((64, 4), dtype=np.uint8))
