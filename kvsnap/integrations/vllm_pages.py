"""Between vLLM's paged KV cache on CPU and kvsnap's block layout, for the vLLM connector. No vLLM here.

vLLM's CPU attention (CPU_ATTN with its ``vec`` kernels) keeps one tensor per layer,
``[num_blocks, kv_heads, block_size, 2 * head_dim]``. Within one block and head, the first
``block_size * head_dim`` elements are K stored transposed, ``[head_dim, block_size]`` (the kernel
reads K a column of tokens at a time), and the next ones V, ``[block_size, head_dim]``. A kvsnap block
is ``[layers, 2, kv_heads, tokens, head_dim]`` (K, then V), what kvsnap's own engine stores, so stored
bytes mean the same whichever engine made them and ``kvsnap store check`` and ``export`` read them.
Other kernels pack K their own way (AMX tiles, NEON, ...): the connector refuses them rather than guess.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvsnap.format import codec as codecs
from kvsnap.hashing import checksum
from kvsnap.types import EncodedBlock, KVLayout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_caches(caches: Sequence[torch.Tensor], layout: KVLayout, vllm_block_size: int) -> str | None:
    """Why these per-layer caches are not the CPU layout above for ``layout``, or None."""
    if len(caches) != layout.num_layers:
        return f"{len(caches)} KV cache layers, the model has {layout.num_layers}"
    want = (layout.num_kv_heads, vllm_block_size, 2 * layout.head_dim)
    for cache in caches:
        if cache.ndim != 4 or tuple(cache.shape[1:]) != want:
            return f"KV cache of shape {tuple(cache.shape)}, expected [blocks, {', '.join(map(str, want))}]"
        if cache.dtype != DTYPES[layout.dtype] or cache.device.type != "cpu":
            return f"KV cache of {cache.dtype} on {cache.device}, expected {layout.dtype} on cpu"
        if cache.stride(-1) != 1 or cache.stride(-2) != 2 * layout.head_dim:
            return "a KV cache whose blocks are not laid out densely"
    return None


def bits(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as a numpy array of same-size unsigned integers (numpy has no bfloat16):
    every copy here moves bits, never values."""
    return tensor.view(_TORCH_BITS[tensor.element_size()]).numpy().view(_NUMPY_BITS[tensor.element_size()])


# The copies run in numpy, on one thread: torch's many small strided copies wait on the engine's
# OpenMP threads, which spin against each other on a busy machine (docs/benchmarks.md).
_TORCH_BITS = {2: torch.int16, 4: torch.int32}
_NUMPY_BITS = {2: np.uint16, 4: np.uint32}


def gather(caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> np.ndarray:
    """vLLM blocks ``block_ids`` (in token order) as one kvsnap block, ``[layers, 2, kv_heads, tokens,
    head_dim]`` (``bits``)."""
    ids = np.asarray(block_ids, dtype=np.int64)
    _, heads, n, two_d = caches[0].shape
    d, m = two_d // 2, len(block_ids)
    out = np.empty((len(caches), 2, heads, m * n, d), dtype=_NUMPY_BITS[caches[0].element_size()])
    for layer, cache in enumerate(caches):
        page = bits(cache)[ids].reshape(m, heads, 2, n * d)  # [m, heads, K | V, n * d]
        k = page[:, :, 0].reshape(m, heads, d, n).transpose(1, 0, 3, 2)  # [heads, m, n, d]
        v = page[:, :, 1].reshape(m, heads, n, d).transpose(1, 0, 2, 3)
        out[layer, 0] = k.reshape(heads, m * n, d)
        out[layer, 1] = v.reshape(heads, m * n, d)
    return out


def scatter(caches: Sequence[torch.Tensor], block_ids: Sequence[int], kv: np.ndarray) -> None:
    """Write ``kv`` (``[layers, 2, kv_heads, tokens, head_dim]``, ``bits``, tokens a whole number of
    vLLM blocks) into vLLM blocks ``block_ids``: the inverse of ``gather``."""
    ids = np.asarray(block_ids, dtype=np.int64)
    _, heads, n, two_d = caches[0].shape
    d, m = two_d // 2, len(block_ids)
    if kv.shape != (len(caches), 2, heads, m * n, d):
        raise ValueError(f"KV of shape {kv.shape} for {m} blocks of {n} tokens")
    for layer, cache in enumerate(caches):
        k = kv[layer, 0].reshape(heads, m, n, d).transpose(1, 0, 3, 2)  # [m, heads, d, n]
        v = kv[layer, 1].reshape(heads, m, n, d).transpose(1, 0, 2, 3)  # [m, heads, n, d]
        page = np.concatenate((k.reshape(m, heads, n * d), v.reshape(m, heads, n * d)), axis=2)
        bits(cache)[ids] = page.reshape(m, heads, n, two_d)


def encode(kv: np.ndarray, h: bytes, codec: str, level: int) -> EncodedBlock:
    """A kvsnap block (``gather``'s result) as the store keeps it."""
    raw = np.ascontiguousarray(kv)
    stored = codecs.encode(memoryview(raw).cast("B"), raw.itemsize, codec, level)
    return EncodedBlock(kv.shape[3], h, raw.nbytes, stored, checksum(stored))


def decoded(raw: bytes | bytearray | np.ndarray, layout: KVLayout, num_tokens: int) -> np.ndarray:
    """A decoded block's raw bytes as ``[layers, 2, kv_heads, tokens, head_dim]`` (``bits``)."""
    shape = (layout.num_layers, 2, layout.num_kv_heads, num_tokens, layout.head_dim)
    return np.frombuffer(raw, dtype=np.uint8).view(_NUMPY_BITS[layout.itemsize]).reshape(shape)
