"""kvsnap/integrations/vllm_pages.py against vLLM's own CPU kernel: what the kernel writes into the
paged cache, ``gather`` reads back as kvsnap's ``[layers, 2, kv_heads, tokens, head_dim]``; what
``scatter`` writes, the kernel's attention reads as the same KV."""

from __future__ import annotations

import pytest
import torch
from vllm import _custom_ops as ops

from kvsnap.integrations import vllm_pages as pages

HEADS, VBS, DIM, BLOCKS = 3, 32, 64, 6


def split(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as vLLM's CPU attention views one layer's cache (vllm/v1/attention/backends/cpu_attn.py)."""
    return cache.view(cache.shape[0], HEADS, VBS * 2, DIM).chunk(2, dim=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_reads_what_vllms_cpu_kernel_wrote(dtype):
    cache = torch.zeros(BLOCKS, HEADS, VBS, 2 * DIM, dtype=dtype)
    block_ids = [4, 1, 3]
    tokens = len(block_ids) * VBS
    key = torch.randn(tokens, HEADS, DIM).to(dtype)
    value = torch.randn(tokens, HEADS, DIM).to(dtype)
    slots = torch.tensor([b * VBS + o for b in block_ids for o in range(VBS)], dtype=torch.long)
    ops.cpu_attn_reshape_and_cache(key, value, *split(cache), slots, "vec")
    got = pages.gather([cache], block_ids)
    want = pages.bits(torch.stack((key.transpose(0, 1), value.transpose(0, 1))).contiguous())
    assert (got[0] == want).all()


def test_scatter_writes_what_the_kernel_would_have_written():
    written, scattered = (torch.zeros(BLOCKS, HEADS, VBS, 2 * DIM) for _ in range(2))
    block_ids = [2, 5]
    key, value = torch.randn(2 * VBS, HEADS, DIM), torch.randn(2 * VBS, HEADS, DIM)
    slots = torch.tensor([b * VBS + o for b in block_ids for o in range(VBS)], dtype=torch.long)
    ops.cpu_attn_reshape_and_cache(key, value, *split(written), slots, "vec")
    kv = torch.stack((key.transpose(0, 1), value.transpose(0, 1)))[None]  # [1, 2, heads, tokens, dim]
    pages.scatter([scattered], block_ids, pages.bits(kv.contiguous()))
    assert torch.equal(scattered, written)
