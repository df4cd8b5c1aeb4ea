"""kvsnap.cache: the adapter between transformers' DynamicCache and per-block raw KV bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import SLIDING, UNSUPPORTED, build_tokenizer, tiny_config
from transformers import LlamaConfig, T5Config

from kvsnap.engine import cache as kvcache
from kvsnap.engine import kv_transfer
from kvsnap.errors import UnsupportedModelError
from kvsnap.models import architecture
from kvsnap.types import KV_DTYPES


@pytest.fixture(scope="module")
def config():
    return tiny_config("llama", build_tokenizer())


def random_buffer(config, tokens: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    layout = architecture.layout_of(config, dtype)
    g = torch.Generator().manual_seed(seed)
    # buf: [layers, 2, kv_heads, tokens, head_dim]
    shape = (layout.num_layers, 2, layout.num_kv_heads, tokens, layout.head_dim)
    return torch.randn(shape, generator=g).to(dtype)


def blocks_of(cache, total: int, block_size: int) -> tuple[list[bytes], list[int]]:
    raws, sizes = [], []
    for start in range(0, total, block_size):
        end = min(start + block_size, total)
        raws.append(cache.block_raw(start, end).tobytes())
        sizes.append(end - start)
    return raws, sizes


def assert_cache_equals(cache, buf: torch.Tensor) -> None:
    assert len(cache.layers) == buf.shape[0]
    for i, layer in enumerate(cache.layers):
        assert torch.equal(layer.keys[0], buf[i, 0]), f"layer {i} keys"
        assert torch.equal(layer.values[0], buf[i, 1]), f"layer {i} values"


def test_dtype_tables_agree_with_the_snapshot_format():
    assert set(architecture.TORCH_DTYPES) == set(KV_DTYPES)
    for name, dtype in architecture.TORCH_DTYPES.items():
        assert torch.empty(0, dtype=dtype).element_size() == KV_DTYPES[name]
        assert architecture.DTYPE_NAMES[dtype] == name


def test_layout_of(config):
    layout = architecture.layout_of(config, torch.bfloat16)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype) == (2, 2, 16, "bfloat16")
    assert layout.bytes_per_token == 2 * 2 * 2 * 16 * 2
    mha = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=None, num_hidden_layers=3)
    assert architecture.layout_of(mha, torch.float32).num_kv_heads == 4
    explicit = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=32)
    assert architecture.layout_of(explicit, torch.float32).head_dim == 32


def test_cache_from_buffer_views_the_buffer_without_copying(config):
    buf = random_buffer(config, 11)
    cache = kvcache.cache_from_buffer(config, buf)
    assert cache.length == 11
    assert_cache_equals(cache, buf)
    for i, layer in enumerate(cache.layers):
        assert layer.keys.data_ptr() == buf[i, 0].data_ptr()
        assert layer.values.data_ptr() == buf[i, 1].data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [1, 4, 5, 64])
def test_block_raw_restore_cache_round_trip_is_bit_exact(config, dtype, block_size):
    total = 13
    buf = random_buffer(config, total, dtype)
    layout = architecture.layout_of(config, dtype)
    cache = kvcache.cache_from_buffer(config, buf)
    raws, sizes = blocks_of(cache, total, block_size)
    for raw, n in zip(raws, sizes):
        assert len(raw) == n * layout.bytes_per_token
    # block_raw is the [layers, 2, kv_heads, tokens, head_dim] slice, byte for byte.
    first = cache.block_raw(0, sizes[0])
    assert first.dtype == np.uint8 and first.flags["C_CONTIGUOUS"]
    expect = buf[:, :, :, : sizes[0]].contiguous().view(torch.uint8).reshape(-1).numpy()
    assert np.array_equal(first, expect)

    restored = kv_transfer.restore_cache(config, layout, raws, sizes, total, torch.device("cpu"))
    assert restored.length == total
    assert_cache_equals(restored, buf)
    for layer in restored.layers:
        assert layer.keys.dtype == dtype

    # Fewer tokens than the blocks hold: a token-granular cut inside the last block read.
    cut = total - 2 if block_size > 2 else total - 1
    needed = -(-cut // block_size)
    part = kv_transfer.restore_cache(config, layout, raws[:needed], sizes[:needed], cut, torch.device("cpu"))
    assert part.length == cut
    assert_cache_equals(part, buf[:, :, :, :cut])


def test_restore_cache_of_zero_tokens(config):
    layout = architecture.layout_of(config, torch.float32)
    empty = kv_transfer.restore_cache(config, layout, [], [], 0, torch.device("cpu"))
    assert empty.length == 0


def test_restore_cache_rejects_blocks_that_do_not_cover_the_tokens(config):
    layout = architecture.layout_of(config, torch.float32)
    buf = random_buffer(config, 4)
    raws, sizes = blocks_of(kvcache.cache_from_buffer(config, buf), 4, 4)
    with pytest.raises(AssertionError):
        kv_transfer.restore_cache(config, layout, raws, sizes, 6, torch.device("cpu"))


def test_crop_cuts_every_layer_even_uneven_ones(config):
    buf = random_buffer(config, 10)
    cache = kvcache.cache_from_buffer(config, buf)
    # A forward interrupted half way: layer 0 grew to 10 tokens, layer 1 only to 7.
    cache.layers[1].keys = cache.layers[1].keys[..., :7, :]
    cache.layers[1].values = cache.layers[1].values[..., :7, :]
    cache.crop(8)
    assert [layer.keys.shape[-2] for layer in cache.layers] == [8, 7]
    assert [layer.values.shape[-2] for layer in cache.layers] == [8, 7]
    cache.crop(5)
    assert [layer.keys.shape[-2] for layer in cache.layers] == [5, 5]
    assert_cache_equals(cache, buf[:, :, :, :5])
    cache.crop(50)  # longer than the cache: nothing changes
    assert cache.length == 5


def test_crop_of_a_fresh_cache_is_a_no_op(config):
    cache = kvcache.KVCache(config)
    cache.crop(0)
    assert cache.length == 0


def test_model_cache_round_trips_and_continues_identically(llama):
    """A real forward's cache -> blocks -> restored cache: same tensors, and the next forward gives the same logits."""
    lm = llama
    ids = torch.tensor([list(range(5, 35))])
    nxt = torch.tensor([[40, 41, 42]])

    def run(ids, cache, start):
        pos = torch.arange(start, start + ids.shape[1]).unsqueeze(0)
        with torch.inference_mode():
            out = lm.model(input_ids=ids, position_ids=pos, use_cache=True, **{lm.cache_kwarg: cache})
        return out.logits[0, -1]

    live = kvcache.cache_for(lm)
    run(ids, live, 0)
    assert live.length == 30
    raws, sizes = blocks_of(live, 30, 8)
    restored = kv_transfer.restore_cache(lm.config, lm.layout, raws, sizes, 30, lm.device)
    for a, b in zip(live.layers, restored.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    expect = run(nxt, live, 30)
    got = run(nxt, restored, 30)
    assert torch.equal(got, expect)
    assert restored.length == 33


def test_forward_cache_kwarg():
    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None):
            pass

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None):
            pass

    assert architecture.forward_cache_kwarg(New()) == "cache"
    assert architecture.forward_cache_kwarg(Old()) == "past_key_values"


def test_check_supported(config):
    architecture.check_supported(config)  # full attention: fine
    tok = build_tokenizer()
    for kind in SLIDING:  # sliding windows of the families kvsnap resumes exactly: fine too
        architecture.check_supported(tiny_config(kind, tok))
    for kind in UNSUPPORTED:
        cfg = tiny_config(kind, tok)
        with pytest.raises(UnsupportedModelError, match=cfg.model_type):
            architecture.check_supported(cfg)
    with pytest.raises(UnsupportedModelError, match="encoder-decoder"):
        architecture.check_supported(T5Config(num_layers=1, d_model=16, d_kv=4, num_heads=2, d_ff=32))


@pytest.mark.parametrize("slots", [1, 2, 4])
def test_the_staging_ring_restores_what_the_direct_path_does(slots):
    """The GPU path (blocks staged through a ring of a few host slots, then copied to the device)
    runs here with the CPU as the device: same bits as the direct path, in any order, from many
    threads, and never more staging than ``slots`` blocks."""
    from concurrent.futures import ThreadPoolExecutor

    config = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32)
    layout = architecture.layout_of(config, torch.float32)
    total, bs = 70, 8
    buf = torch.randn(2, 2, 2, total, 8)
    raws, sizes = blocks_of(kvcache.cache_from_buffer(config, buf), total, bs)
    direct = kv_transfer.restore_cache(config, layout, raws, sizes, total, torch.device("cpu"))
    ring = kv_transfer.KVTransfer(layout, total, torch.device("cpu"), block_tokens=bs, ring_slots=slots)
    starts = [i * bs for i in range(len(raws))]
    writable = [bytearray(r) for r in raws]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: ring.write(starts[i], sizes[i], writable[i]), reversed(range(len(raws)))))
    restored = ring.finish(config)
    assert ring.staging_bytes == slots * bs * layout.bytes_per_token
    for a, b in zip(direct.layers, restored.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize(
    ("codec", "kv_dtype", "dtype"),
    [
        ("shuffle-zstd", None, "float32"),
        ("shuffle-zstd", None, "bfloat16"),
        ("shuffle-zstd", "float16", "float32"),
        ("zstd", None, "float32"),
        ("raw", None, "bfloat16"),
        ("int8-zstd", None, "float32"),
    ],
)
def test_a_restore_staged_in_stored_order_equals_the_direct_one(tiny_lm, tmp_path, monkeypatch, codec, kv_dtype, dtype):
    """The device path: each block decoded into a ring slot in the order it is stored (byte planes for
    shuffle-zstd: the entropy stage only), copied as it is and interleaved by torch ops on the device.
    Run here with the CPU as the device: the same bits as the direct restore, a partial tail included."""
    from kvsnap.engine import restore as restoring
    from kvsnap.engine.session import Session

    lm = tiny_lm("llama", dtype)
    s = Session(lm, block_size=8, codec=codec, kv_dtype=kv_dtype)
    s.prefill(list(range(5, 5 + 45)))  # 5 full blocks and a 5-token tail
    s.save(tmp_path / "a.kv")
    direct = Session(lm, block_size=8, codec=codec, kv_dtype=kv_dtype)
    direct.restore(tmp_path / "a.kv")
    staged_kinds = []
    real = kv_transfer.KVTransfer

    def through_ring(*args, **kwargs):
        transfer = real(*args, ring_slots=2, **kwargs)
        staged_kinds.append(transfer.planes)
        return transfer

    monkeypatch.setattr(restoring, "KVTransfer", through_ring)
    staged = Session(lm, block_size=8, codec=codec, kv_dtype=kv_dtype)
    staged.restore(tmp_path / "a.kv")
    assert staged_kinds == [codec == "shuffle-zstd"] and staged.tokens == direct.tokens
    for a, b in zip(direct.cache.layers, staged.cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_a_damaged_block_staged_through_the_ring_gives_its_slot_back(tiny_lm, tmp_path, monkeypatch):
    """A block that fails to decode into its slot must not leave the other readers waiting for one."""
    from kvsnap.engine import restore as restoring
    from kvsnap.engine.session import Session
    from kvsnap.errors import SnapshotError
    from kvsnap.format import Snapshot

    lm = tiny_lm("llama")
    s = Session(lm, block_size=8)
    s.prefill(list(range(5, 5 + 64)))
    path = tmp_path / "a.kv"
    s.save(path)
    real = kv_transfer.KVTransfer
    monkeypatch.setattr(restoring, "KVTransfer", lambda *a, **k: real(*a, ring_slots=1, **k))
    failing = {"n": 0}
    real_decode = Snapshot.decode_block_into

    def decode(self, index, stored, dst):
        if index in (2, 5):
            failing["n"] += 1
            raise SnapshotError(f"block {index} does not decode (test)")
        return real_decode(self, index, stored, dst)

    monkeypatch.setattr(Snapshot, "decode_block_into", decode)
    with pytest.raises(SnapshotError, match="does not decode"):
        Session(lm, block_size=8).restore(path)  # returns (does not hang) with one slot and two failures
    assert failing["n"] >= 1
