"""Between vLLM's paged CPU KV cache and kvsnap's blocks (kvsnap/integrations/vllm_pages.py), without
vLLM: the layout is written out here from vLLM's CPU kernel (K transposed within a block, V not), and
tests/integration_vllm/test_pages.py checks it against the kernel itself."""

from __future__ import annotations

import pytest
import torch

from kvsnap.hashing import chain_hashes, chain_root
from kvsnap.integrations import vllm_pages as pages
from kvsnap.store import BlockStore, ChainInfo
from kvsnap.types import KVLayout

LAYERS, HEADS, VBS, DIM = 3, 2, 4, 8


def paged(num_blocks: int = 10, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.zeros(num_blocks, HEADS, VBS, 2 * DIM, dtype=dtype) for _ in range(LAYERS)]


def write_like_the_kernel(caches: list[torch.Tensor], slots: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
    """vLLM's vec kernel: K of token t goes to key_cache[block, head, d * block_size + offset], V to
    value_cache[block, head, offset * head_dim + d], both regions of one ``[block, head]`` page."""
    for layer, cache in enumerate(caches):
        flat = cache.view(cache.shape[0], HEADS, 2, VBS * DIM)
        for t, slot in enumerate(slots):
            block, offset = divmod(slot, VBS)
            for h in range(HEADS):
                for d in range(DIM):
                    flat[block, h, 0, d * VBS + offset] = k[layer, h, t, d]
                flat[block, h, 1, offset * DIM : (offset + 1) * DIM] = v[layer, h, t]


def kv(tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(LAYERS, 2, HEADS, tokens, DIM, generator=torch.Generator().manual_seed(seed))


def test_gather_reads_what_the_kernel_wrote_in_token_order():
    caches, block_ids = paged(), [7, 2, 5]  # a request's blocks need not be in order
    want = kv(3 * VBS)
    slots = [b * VBS + o for b in block_ids for o in range(VBS)]
    write_like_the_kernel(caches, slots, want[:, 0], want[:, 1])
    got = pages.gather(caches, block_ids)
    assert got.shape == (LAYERS, 2, HEADS, 3 * VBS, DIM) and (got == pages.bits(want)).all()


def test_scatter_is_the_inverse_of_gather_and_touches_no_other_block():
    caches = paged(dtype=torch.bfloat16)
    want = pages.bits(kv(2 * VBS, seed=1).to(torch.bfloat16))
    pages.scatter(caches, [3, 8], want)
    assert (pages.gather(caches, [3, 8]) == want).all()
    others = [b for b in range(10) if b not in (3, 8)]
    assert all(not c[others].any() for c in caches)
    with pytest.raises(ValueError, match="blocks"):
        pages.scatter(caches, [3], want)


def test_a_scattered_slice_of_a_block_lands_in_its_own_vllm_blocks():
    """A load that starts inside a store block (vLLM held the first vLLM blocks) writes only the rest."""
    caches = paged()
    block = pages.bits(kv(4 * VBS, seed=2))
    pages.scatter(caches, [4, 6], block[:, :, :, 2 * VBS :])
    assert (pages.gather(caches, [4, 6]) == block[:, :, :, 2 * VBS :]).all()


def test_a_block_encoded_for_the_store_decodes_to_the_same_kv(tmp_path):
    layout = KVLayout(LAYERS, HEADS, DIM, "bfloat16")
    caches = paged(dtype=torch.bfloat16)
    want = pages.bits(kv(2 * VBS, seed=3).to(torch.bfloat16))
    pages.scatter(caches, [1, 9], want)
    tokens, bs = list(range(2 * VBS)), 2 * VBS
    root = chain_root("fingerprint", "", bs)
    (h,) = chain_hashes(tokens, bs, root)
    store = BlockStore(tmp_path / "store")
    block = pages.encode(pages.gather(caches, [1, 9]), h, "shuffle-zstd", 1)
    store.put(ChainInfo(root, "m", "fingerprint", layout, bs), tokens, [block], codec="shuffle-zstd")
    _, (stored,) = store.fetch(tokens, root, bs)
    assert (pages.decoded(stored.decode(layout.itemsize), layout, bs) == want).all()
    assert store.check() == []


def test_caches_of_another_layout_are_named():
    layout = KVLayout(LAYERS, HEADS, DIM, "float32")
    assert pages.check_caches(paged(), layout, VBS) is None
    assert "layers" in pages.check_caches(paged()[:2], layout, VBS)
    assert "shape" in pages.check_caches(paged(), KVLayout(LAYERS, HEADS, 2 * DIM, "float32"), VBS)
    assert "float32" in pages.check_caches(paged(dtype=torch.bfloat16), layout, VBS)
