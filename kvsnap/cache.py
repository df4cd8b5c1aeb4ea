"""The only module that knows transformers' cache API (5.17 and up).

Per-block raw KV bytes in, a ``DynamicCache`` the model accepts out, and back. transformers
5.x moves this API between minor versions (``past_key_values`` became ``cache``, layers moved
to ``cache.layers[i].keys/values``), so every access goes through here.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Sequence

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvsnap.errors import UnsupportedModelError
from kvsnap.snapshot import KVLayout

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def forward_cache_kwarg(model: torch.nn.Module) -> str:
    """Name of the forward argument that takes the cache: ``cache`` (5.2x) or ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def new_cache(config) -> DynamicCache:
    return DynamicCache(config=config)


def check_supported(config) -> None:
    """Refuse models whose cache is not a plain full-attention ``DynamicCache``."""
    model_type = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"model type {model_type!r} is an encoder-decoder model; kvsnap needs a decoder")
    try:
        cache = DynamicCache(config=config)
    except Exception as exc:
        raise UnsupportedModelError(f"model type {model_type!r}: cannot build its cache ({exc})") from None
    kinds = {type(layer).__name__ for layer in cache.layers}
    if not cache.layers or kinds != {DynamicLayer.__name__}:
        raise UnsupportedModelError(
            f"model type {model_type!r} uses a {'/'.join(sorted(kinds)) or 'custom'} cache (sliding-window, hybrid "
            "or recurrent); kvsnap supports full-attention decoders (Llama, Mistral, Qwen2/3, Phi-3, OLMo, Granite)"
        )


def layout_of(config, dtype: torch.dtype) -> KVLayout:
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return KVLayout(text.num_hidden_layers, kv_heads, head_dim, DTYPE_NAMES[dtype])


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def crop(cache: DynamicCache, length: int) -> None:
    """Cut every layer back to ``length`` tokens.

    Per layer, not ``cache.crop``: a forward interrupted half way may have grown only some layers.
    """
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if keys is not None and keys.dim() == 4 and keys.shape[-2] > length:
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


def block_raw(cache: DynamicCache, start: int, end: int) -> np.ndarray:
    """Tokens ``[start, end)`` of the cache as raw bytes in the block layout (uint8, contiguous)."""
    # block: [layers, 2, kv_heads, tokens, head_dim]
    parts = []
    for layer in cache.layers:
        parts.append(torch.stack((layer.keys[0, :, start:end], layer.values[0, :, start:end])))
    block = torch.stack(parts).contiguous()
    if block.device.type != "cpu":
        block = block.cpu()
    return block.view(torch.uint8).reshape(-1).numpy()


def restore_cache(
    config,
    layout: KVLayout,
    blocks: Sequence[bytes | bytearray],
    block_tokens: Sequence[int],
    num_tokens: int,
    device: torch.device,
) -> DynamicCache:
    """Build a cache holding the first ``num_tokens`` tokens of the given raw blocks, in order.

    Each block is copied straight into its slice of one preallocated
    ``[layers, 2, kv_heads, tokens, head_dim]`` buffer; the cache layers are views of it, so the
    KV is bitwise the stored KV and no concatenation happens block by block.
    """
    dtype = TORCH_DTYPES[layout.dtype]
    L, H, D = layout.num_layers, layout.num_kv_heads, layout.head_dim
    pin = device.type == "cuda"
    buf = torch.empty((L, 2, H, num_tokens, D), dtype=dtype, pin_memory=pin)
    fill_blocks(buf, layout, blocks, block_tokens)
    if device.type != "cpu":
        buf = buf.to(device, non_blocking=True)
    return cache_from_buffer(config, buf)


def fill_blocks(
    buf: torch.Tensor, layout: KVLayout, blocks: Sequence[bytes | bytearray], block_tokens: Sequence[int]
) -> None:
    dtype = TORCH_DTYPES[layout.dtype]
    L, H, D = layout.num_layers, layout.num_kv_heads, layout.head_dim
    total = buf.shape[3]
    pos = 0
    with warnings.catch_warnings():
        # torch warns that read-only buffers give read-only tensors; we only read from them.
        warnings.simplefilter("ignore", UserWarning)
        for raw, n in zip(blocks, block_tokens):
            use = min(n, total - pos)
            if use <= 0:
                break
            src = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(L, 2, H, n, D)
            buf[:, :, :, pos : pos + use].copy_(src[:, :, :, :use])
            pos += use
    assert pos == total, f"blocks cover {pos} tokens, expected {total}"


def cache_from_buffer(config, buf: torch.Tensor) -> DynamicCache:
    """A cache whose layer ``i`` is ``buf[i, 0]`` (keys) and ``buf[i, 1]`` (values), without copying."""
    # buf: [layers, 2, kv_heads, tokens, head_dim]
    cache = new_cache(config)
    for i, layer in enumerate(cache.layers):
        k = buf[i, 0].unsqueeze(0)
        v = buf[i, 1].unsqueeze(0)
        # Initialise the layer with an empty update (sets dtype/device the version's way), then
        # point it at the buffer: update() would concatenate, i.e. copy everything once more.
        layer.update(k[:, :, :0], v[:, :, :0])
        layer.keys, layer.values = k, v
    return cache
