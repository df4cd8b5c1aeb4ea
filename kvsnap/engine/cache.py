"""The only module that knows transformers' cache API (5.17 and up).

Per-block raw KV bytes in, a ``KVCache`` (a ``DynamicCache`` the model accepts) out, and back. transformers
5.x moves this API between minor versions (``past_key_values`` became ``cache``, layers moved
to ``cache.layers[i].keys/values``), so every access goes through here. transformers is imported
only for a model it runs: the native forward (``kvsnap.models.native``) gets a ``PlainKVCache``.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from kvsnap.engine import arena
from kvsnap.models.architecture import TORCH_DTYPES
from kvsnap.types import KVLayout


class _Buffered:
    """A full-attention layer whose ``keys``/``values`` are views of buffers with spare room.

    The stock layer concatenates on every update, copying the whole history once per forward
    (at a 4k context, 190 MB per decoded token for the default model). Here an update writes
    only the new tokens; the buffer grows geometrically when full. Mixed into transformers'
    ``DynamicLayer`` (``_transformers_classes``) or, for the native forward, into ``PlainLayer``.
    """

    _kbuf: torch.Tensor | None = None  # [B, H, capacity, D]
    _vbuf: torch.Tensor | None = None
    # A sliding-window layer: how many positions a query attends to, its own included (None: all).
    # The layer still holds every position, so blocks and snapshots stay per token for every layer;
    # only what the attention is handed is cut to the window.
    window: int | None = None
    # The buffers' dtype, where it differs from the activations' (a quantized model's float16 KV under float32
    # activations): an update stores the new rows rounded to it, and hands the attention every position back in
    # the activations' dtype, the new rows as rounded as the ones read back later. None: the first update's.
    dtype: torch.dtype | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._kbuf = self._vbuf = None
        length = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        need = length + key_states.shape[-2]
        if self._kbuf is None or need > self._kbuf.shape[-2] or not self._holds_keys():
            self._grow(key_states, length, max(need, 2 * length, 256))
        self._kbuf[:, :, length:need].copy_(key_states)
        self._vbuf[:, :, length:need].copy_(value_states)
        self.keys = self._kbuf[:, :, :need]
        self.values = self._vbuf[:, :, :need]
        start = self.first_visible(length)
        keys, values = self.keys[:, :, start:], self.values[:, :, start:]
        if keys.dtype != key_states.dtype:
            return keys.to(key_states.dtype), values.to(value_states.dtype)
        return keys, values

    def extend(self, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``update`` without the copy: hold ``n`` more positions (their keys and values shaped as ``like``,
        [B, H, n, D], are the caller's to write) and return every position's keys and values, views into
        the buffers. For a forward that writes the new KV in place (``kvsnap.models.qstep``); a layer with
        a window is never extended."""
        if not self.is_initialized:
            self.lazy_initialization(like, like)
            self._kbuf = self._vbuf = None
        length = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        need = length + n
        if self._kbuf is None or need > self._kbuf.shape[-2] or not self._holds_keys():
            self._grow(like, length, max(need, 2 * length, 256))
        self.keys = self._kbuf[:, :, :need]
        self.values = self._vbuf[:, :, :need]
        return self.keys, self.values

    def first_visible(self, length: int) -> int:
        """The first position the next queries may see after ``length`` held ones: the oldest one the
        first query's window reaches (later queries' masks cut further). 0 for a full-attention layer."""
        return 0 if self.window is None else max(length - self.window + 1, 0)

    def _holds_keys(self) -> bool:
        """Whether ``keys`` is still the start of ``_kbuf`` (nothing replaced it). Compared by storage and
        offset: an empty view's ``data_ptr()`` is 0, which made a buffer ``reserve`` attached to a fresh
        cache look foreign, so its first chunk regrew one of its own and dropped the reserved one."""
        k, buf = self.keys, self._kbuf
        return (
            k.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
            and k.storage_offset() == buf.storage_offset()
        )

    def _grow(self, like: torch.Tensor, length: int, capacity: int) -> None:
        b, h, _, d = like.shape
        kbuf = torch.empty((b, h, capacity, d), dtype=self.dtype or like.dtype, device=like.device)
        vbuf = torch.empty_like(kbuf)
        if length:
            kbuf[:, :, :length].copy_(self.keys)
            vbuf[:, :, :length].copy_(self.values)
        self._kbuf, self._vbuf = kbuf, vbuf

    def attach(self, keys_buf: torch.Tensor, values_buf: torch.Tensor, length: int) -> None:
        """Hold ``length`` tokens that already sit at the start of the given [B, H, capacity, D] buffers."""
        self.lazy_initialization(keys_buf[:, :, :0], values_buf[:, :, :0])
        self._kbuf, self._vbuf, self.dtype = keys_buf, values_buf, keys_buf.dtype
        self.keys = keys_buf[:, :, :length]
        self.values = values_buf[:, :, :length]


class PlainLayer(_Buffered):
    """A buffered layer without transformers, for ``kvsnap.models.native``."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.is_initialized = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.keys = key_states.new_empty(0)
        self.values = value_states.new_empty(0)
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self.keys.shape[-2] if self.is_initialized and self.keys.dim() == 4 else 0


class KVCache:
    """The cache kvsnap hands the model, plus the few operations the engine needs (length, crop,
    reserve, a block's raw bytes).

    ``KVCache(config)`` makes a ``PlainKVCache`` for a config ``kvsnap.models.native`` read (the
    native forward needs no transformers class, and so a process running it never imports
    transformers' cache module), else a ``DynamicCache`` subclass transformers' models accept,
    whose layers append in place and keep every position, a sliding-window layer's too. Only configs
    that pass ``check_supported`` get here. ``dtype``: the buffers' (``cache_for`` passes the model's KV dtype).
    """

    layers: list

    def __new__(cls, config=None, dtype: torch.dtype | None = None):
        if cls is KVCache:
            cls = PlainKVCache if getattr(config, "plain", False) else _transformers_classes()[1]
        return super().__new__(cls)

    def hold_dtype(self, dtype: torch.dtype | None) -> None:
        for layer in self.layers:
            if isinstance(layer, _Buffered):
                layer.dtype = dtype

    @property
    def length(self) -> int:
        return self.get_seq_length()

    def crop(self, length: int) -> None:
        """Cut every layer back to ``length`` tokens (no-op for layers already shorter).

        Per layer, not ``DynamicCache.crop``: a forward interrupted half way may have grown only some layers.
        """
        for layer in self.layers:
            keys = getattr(layer, "keys", None)
            if keys is not None and keys.dim() == 4 and keys.shape[-2] > length:
                layer.keys = layer.keys[..., :length, :]
                layer.values = layer.values[..., :length, :]

    def reserve(self, capacity: int, layout: KVLayout, device: torch.device) -> None:
        """Give every layer room for ``capacity`` tokens now, so a long prefill never regrows (and
        briefly doubles) its buffers chunk after chunk."""
        buffered = [layer for layer in self.layers if isinstance(layer, _Buffered)]
        if all(layer._kbuf is not None and layer._kbuf.shape[-2] >= capacity for layer in buffered):
            return
        # One buffer for all layers, from the process's arena: its pages are mapped already when an
        # earlier cache of this shape has been dropped.
        buf = arena.kv_buffer(
            layout.num_layers, layout.num_kv_heads, layout.head_dim, capacity, TORCH_DTYPES[layout.dtype], device
        )
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, _Buffered):
                continue
            length = layer.keys.shape[-2] if layer.is_initialized and layer.keys.dim() == 4 else 0
            kbuf, vbuf = buf[i, 0].unsqueeze(0), buf[i, 1].unsqueeze(0)
            if length:
                kbuf[:, :, :length].copy_(layer.keys)
                vbuf[:, :, :length].copy_(layer.values)
            layer.attach(kbuf, vbuf, length)

    def span(self, start: int, end: int) -> torch.Tensor:
        """Tokens ``[start, end)`` of every layer: ``[layers, 2, kv_heads, tokens, head_dim]``, a copy on the device."""
        return torch.stack(
            [torch.stack((layer.keys[0, :, start:end], layer.values[0, :, start:end])) for layer in self.layers]
        )

    def copy_prefix(self, config, length: int, capacity: int) -> KVCache:
        """A new cache holding a copy of the first ``length`` tokens, with room for ``capacity``: work on
        it (a recompute to compare) leaves this cache as it is."""
        first = self.layers[0].keys
        buf = arena.kv_buffer(len(self.layers), first.shape[1], first.shape[3], capacity, first.dtype, first.device)
        for i, layer in enumerate(self.layers):
            buf[i, 0, :, :length].copy_(layer.keys[0, :, :length])
            buf[i, 1, :, :length].copy_(layer.values[0, :, :length])
        return cache_from_buffer(config, buf, length)

    def block_raw(self, start: int, end: int, dtype: str | None = None) -> np.ndarray:
        """Tokens ``[start, end)`` as raw bytes in the block layout (uint8, contiguous), cast to
        ``dtype`` first if given (a narrower storage width)."""
        block = self.span(start, end)
        if dtype is not None and TORCH_DTYPES[dtype] != block.dtype:
            block = block.to(TORCH_DTYPES[dtype])
        block = block.contiguous()
        if block.device.type != "cpu":
            block = block.cpu()
        return block.view(torch.uint8).reshape(-1).numpy()


class PlainKVCache(KVCache):
    """The cache of the native forward: one ``PlainLayer`` per layer, the calls it makes."""

    def __init__(self, config, dtype: torch.dtype | None = None):
        self.layers = [PlainLayer() for _ in range(config.num_hidden_layers)]
        self.hold_dtype(dtype)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length()


@functools.cache
def _transformers_classes() -> tuple[type, type]:
    """``(BufferedLayer, TransformersKVCache)``: the buffered layer and the cache as transformers'
    ``DynamicLayer``/``DynamicCache`` subclasses, made on first use (imports transformers)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    class BufferedLayer(_Buffered, DynamicLayer):
        pass

    class BufferedSlidingLayer(BufferedLayer):
        """A sliding-window layer to transformers (``is_sliding``, the mask sizes of its
        ``DynamicSlidingWindowLayer``) that holds every position, the ones past its window included."""

        is_sliding = True

        def __init__(self, window: int):
            super().__init__()
            self.window = window

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            # (kv_length, kv_offset) of the keys ``update`` returns: transformers builds the mask on
            # absolute positions from these, so each query sees exactly the window it would see in one
            # forward over the whole prompt, however the prompt was cut into chunks.
            length = self.get_seq_length()
            start = self.first_visible(length)
            return length - start + query_length, start

    class TransformersKVCache(KVCache, DynamicCache):
        def __init__(self, config, dtype: torch.dtype | None = None):
            DynamicCache.__init__(self, config=config)
            for i, layer in enumerate(self.layers):
                if type(layer) is DynamicLayer:
                    self.layers[i] = BufferedLayer()
                elif type(layer) is DynamicSlidingWindowLayer:  # check_supported let only true windows through
                    self.layers[i] = BufferedSlidingLayer(layer.sliding_window)
            self.hold_dtype(dtype)

    return BufferedLayer, TransformersKVCache


def cache_for(lm) -> KVCache:
    """An empty cache for ``lm`` (a ``LoadedModel``), its buffers in the model's KV dtype."""
    return KVCache(lm.config, TORCH_DTYPES[lm.layout.dtype])


def cache_from_buffer(config, buf: torch.Tensor, length: int | None = None) -> KVCache:
    """A cache whose layer ``i`` holds ``buf[i, 0, :, :length]`` (keys) and ``buf[i, 1, :, :length]`` (values).

    No copy: the layers are views of ``buf``, and later tokens go into its spare room.
    """
    # buf: [layers, 2, kv_heads, capacity, head_dim]
    length = buf.shape[3] if length is None else length
    cache = KVCache(config)
    for i, layer in enumerate(cache.layers):
        layer.attach(buf[i, 0].unsqueeze(0), buf[i, 1].unsqueeze(0), length)
    return cache
