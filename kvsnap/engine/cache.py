"""The only module that knows transformers' cache API (5.17 and up).

Per-block raw KV bytes in, a ``KVCache`` (a ``DynamicCache`` the model accepts) out, and back. transformers
5.x moves this API between minor versions (``past_key_values`` became ``cache``, layers moved
to ``cache.layers[i].keys/values``), so every access goes through here. transformers is imported
only for a model it runs: the native forward (``kvsnap.models.native``) gets a ``PlainKVCache``.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from kvsnap.engine import arena
from kvsnap.errors import UnsupportedModelError
from kvsnap.types import KVLayout

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def forward_cache_kwarg(model: torch.nn.Module) -> str:
    """Name of the forward argument that takes the cache: ``cache`` (5.2x) or ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class _Buffered:
    """A full-attention layer whose ``keys``/``values`` are views of buffers with spare room.

    The stock layer concatenates on every update, copying the whole history once per forward
    (at a 4k context, 190 MB per decoded token for the default model). Here an update writes
    only the new tokens; the buffer grows geometrically when full. Mixed into transformers'
    ``DynamicLayer`` (``_transformers_classes``) or, for the native forward, into ``PlainLayer``.
    """

    _kbuf: torch.Tensor | None = None  # [B, H, capacity, D]
    _vbuf: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._kbuf = self._vbuf = None
        length = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        need = length + key_states.shape[-2]
        if self._kbuf is None or need > self._kbuf.shape[-2] or self.keys.data_ptr() != self._kbuf.data_ptr():
            self._grow(key_states, length, max(need, 2 * length, 256))
        self._kbuf[:, :, length:need].copy_(key_states)
        self._vbuf[:, :, length:need].copy_(value_states)
        self.keys = self._kbuf[:, :, :need]
        self.values = self._vbuf[:, :, :need]
        return self.keys, self.values

    def _grow(self, like: torch.Tensor, length: int, capacity: int) -> None:
        b, h, _, d = like.shape
        kbuf = torch.empty((b, h, capacity, d), dtype=like.dtype, device=like.device)
        vbuf = torch.empty_like(kbuf)
        if length:
            kbuf[:, :, :length].copy_(self.keys)
            vbuf[:, :, :length].copy_(self.values)
        self._kbuf, self._vbuf = kbuf, vbuf

    def attach(self, keys_buf: torch.Tensor, values_buf: torch.Tensor, length: int) -> None:
        """Hold ``length`` tokens that already sit at the start of the given [B, H, capacity, D] buffers."""
        self.lazy_initialization(keys_buf[:, :, :0], values_buf[:, :, :0])
        self._kbuf, self._vbuf = keys_buf, values_buf
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
    whose full-attention layers append in place. Only configs that pass ``check_supported`` get here.
    """

    layers: list

    def __new__(cls, config=None):
        if cls is KVCache:
            cls = PlainKVCache if getattr(config, "plain", False) else _transformers_classes()[1]
        return super().__new__(cls)

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

    def __init__(self, config):
        self.layers = [PlainLayer() for _ in range(config.num_hidden_layers)]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length()


@functools.cache
def _transformers_classes() -> tuple[type, type]:
    """``(BufferedLayer, TransformersKVCache)``: the buffered layer and the cache as transformers'
    ``DynamicLayer``/``DynamicCache`` subclasses, made on first use (imports transformers)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class BufferedLayer(_Buffered, DynamicLayer):
        pass

    class TransformersKVCache(KVCache, DynamicCache):
        def __init__(self, config):
            DynamicCache.__init__(self, config=config)
            for i, layer in enumerate(self.layers):
                if type(layer) is DynamicLayer:
                    self.layers[i] = BufferedLayer()

    return BufferedLayer, TransformersKVCache


def check_supported(config) -> None:
    """Refuse models whose cache is not a plain full-attention ``DynamicCache``."""
    model_type = getattr(config, "model_type", "?")
    if getattr(config, "plain", False):
        return  # kvsnap.models.native.plain_config takes full-attention decoders only
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

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


# Restores to a GPU stage their blocks through a small ring of pinned host buffers (fast
# non-blocking copies; pinning costs on first use in a process); benchmarks/cuda_check.py turns
# pinning off to measure both.
PIN_STAGING = True
RING_SLOTS = 4  # blocks in flight between decode threads and the device: enough to overlap, never the prefix


class Restorer:
    """Decoded blocks go into one preallocated ``[layers, 2, kv_heads, capacity, head_dim]`` buffer on the device.

    ``write`` may be called from several threads at once (each block has its own slice). On the
    CPU a block is copied straight into its slice. On a GPU (or when ``ring_slots`` is given, which
    runs the same path on the CPU) each block goes through one of a few pinned host slots and is
    copied to the device with a non-blocking copy on a side stream, so reading, decoding and
    copying overlap; a slot is reused only once its copy is done, so staging never holds more than
    ``ring_slots`` blocks, however long the prefix.
    """

    def __init__(
        self,
        layout: KVLayout,
        num_tokens: int,
        device: torch.device,
        capacity: int | None = None,
        storage_dtype: str | None = None,
        *,
        block_tokens: int | None = None,
        ring_slots: int | None = None,
    ):
        self.layout = layout
        # Blocks stored narrower than the cache (opt-in) are cast back as they are copied in.
        self.source_dtype = TORCH_DTYPES[storage_dtype or layout.dtype]
        self.source_bytes_per_token = layout.bytes_per_token // layout.itemsize * self.source_dtype.itemsize
        self.num_tokens = num_tokens
        self.device = device
        self.dtype = TORCH_DTYPES[layout.dtype]
        L, H, D = layout.num_layers, layout.num_kv_heads, layout.head_dim
        self.buf = arena.kv_buffer(L, H, D, max(capacity or 0, num_tokens), self.dtype, device)
        self.capacity = self.buf.shape[3]
        self.ring: _Ring | None = None
        self._bytes: np.ndarray | None = None  # the buffer's bytes as numpy, made on first use
        if num_tokens and (ring_slots is not None or device.type != "cpu"):
            per_slot = min(block_tokens or num_tokens, num_tokens)
            self.ring = _Ring(ring_slots or RING_SLOTS, (L, 2, H, per_slot, D), self.dtype, device)

    def target(self, start: int, block_tokens: int) -> np.ndarray | None:
        """Where a whole block starting at ``start`` can be decoded straight into (a uint8 view of the
        buffer, last axis the element's bytes), or None when it must come through ``write``: a
        device buffer, a narrower stored dtype, or a block only partly used."""
        if self.ring is not None or self.device.type != "cpu" or self.source_dtype != self.dtype:
            return None
        if start + block_tokens > self.num_tokens:
            return None
        if self._bytes is None:
            L, _, H, cap, D = self.buf.shape
            self._bytes = self.buf.view(torch.uint8).numpy().reshape(L, 2, H, cap, D, self.dtype.itemsize)
        return self._bytes[:, :, :, start : start + block_tokens]

    @property
    def staging_bytes(self) -> int:
        """Host memory staged between decode and the device copy (0 when blocks are copied straight in)."""
        return self.ring.nbytes if self.ring is not None else 0

    @property
    def pinned(self) -> bool:
        return self.ring is not None and self.ring.pinned

    def write(self, start: int, block_tokens: int, raw) -> None:
        """Copy a raw block (``block_tokens`` tokens, of which those before ``num_tokens`` are used) to ``start``."""
        L, H, D = self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim
        use = min(block_tokens, self.num_tokens - start)
        if use <= 0:
            return
        # Runs in reader threads: no warnings.catch_warnings() here (it is not thread-safe); the
        # readers hand in writable scratch buffers, so torch has nothing to warn about.
        src = torch.frombuffer(raw, dtype=torch.uint8, count=block_tokens * self.source_bytes_per_token)
        src = src.view(self.source_dtype).view(L, 2, H, block_tokens, D)[:, :, :, :use]
        dst = self.buf[:, :, :, start : start + use]
        if self.ring is None:
            dst.copy_(src)
        else:
            self.ring.send(src, dst)

    def finish(self, config) -> KVCache:
        self._bytes = None
        if self.ring is not None:
            self.ring.drain()
        return cache_from_buffer(config, self.buf, self.num_tokens)


class _Ring:
    """A few host buffers that blocks pass through on their way to the device (pinned on CUDA)."""

    def __init__(self, slots: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        import queue

        self.device = device
        cuda = device.type == "cuda"
        self.pinned = cuda and PIN_STAGING
        self.buffers = [torch.empty(shape, dtype=dtype, pin_memory=self.pinned) for _ in range(max(1, slots))]
        self.events: list = [None] * len(self.buffers)
        self.free: queue.Queue[int] = queue.Queue()
        for i in range(len(self.buffers)):
            self.free.put(i)
        self.stream = torch.cuda.Stream(device) if cuda else None

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def send(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Stage ``src`` (host) in a free slot and copy it into ``dst`` (device), without waiting for the copy."""
        i = self.free.get()
        try:
            if self.events[i] is not None:
                self.events[i].synchronize()  # the slot's previous copy must be done before it is overwritten
            n = src.shape[3]
            slot = self.buffers[i][:, :, :, :n]
            slot.copy_(src)
            if self.stream is None:
                dst.copy_(slot)
                return
            with torch.cuda.stream(self.stream):
                dst.copy_(slot, non_blocking=self.pinned)
                event = torch.cuda.Event()
                event.record(self.stream)
            self.events[i] = event
        finally:
            self.free.put(i)

    def drain(self) -> None:
        """Wait until every copy has landed, and make the compute stream see them."""
        if self.stream is not None:
            self.stream.synchronize()
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


def restore_cache(
    config,
    layout: KVLayout,
    blocks: Sequence[bytes | bytearray],
    block_tokens: Sequence[int],
    num_tokens: int,
    device: torch.device,
    capacity: int | None = None,
) -> KVCache:
    """Build a cache holding the first ``num_tokens`` tokens of the given raw blocks, in order.

    The cache layers are views of one buffer: the KV is bitwise the stored KV, nothing is
    concatenated block by block, and the tokens that follow (up to ``capacity`` in all) are
    written in place.
    """
    restorer = Restorer(layout, num_tokens, device, capacity)
    pos = 0
    with warnings.catch_warnings():  # one thread here: read-only bytes make torch warn, harmlessly
        warnings.simplefilter("ignore", UserWarning)
        for raw, n in zip(blocks, block_tokens):
            if pos >= num_tokens:
                break
            restorer.write(pos, n, raw)
            pos += n
    if min(pos, num_tokens) != num_tokens:
        raise AssertionError(f"blocks cover {pos} tokens, expected {num_tokens}")
    return restorer.finish(config)


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
