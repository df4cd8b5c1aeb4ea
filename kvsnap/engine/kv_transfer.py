"""Restored blocks into the KV buffer: straight in on the CPU, through a ring of pinned host slots to a GPU.

``KVTransfer`` owns the one ``[layers, 2, kv_heads, capacity, head_dim]`` buffer a restore fills
(from the process's arena) and hands it to ``kvsnap.engine.cache`` as a cache at the end.

Through the ring, the CPU does only the entropy stage: a block is decoded into its slot in the order
it is stored ("wire order"). For ``shuffle-zstd`` that is byte planes (all first bytes, all second
bytes, ...): the slot is copied to the device as it is, and the byte-plane interleave runs there, on
the device's own cores, as one transpose. Raw planes and raw blocks are a plain copy on the CPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from kvsnap.engine import arena
from kvsnap.engine.cache import KVCache, cache_from_buffer
from kvsnap.models.architecture import TORCH_DTYPES
from kvsnap.types import KVLayout

# Restores to a GPU stage their blocks through a small ring of pinned host buffers (fast
# non-blocking copies; pinning costs on first use in a process); benchmarks/cuda_check.py turns
# pinning off to measure both.
PIN_STAGING = True
RING_SLOTS = 4  # blocks in flight between decode threads and the device: enough to overlap, never the prefix


class KVTransfer:
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
        planes: bool = False,
    ):
        """``planes``: blocks staged through the ring arrive as byte planes (the ``shuffle-zstd`` codec's
        stored order, see ``stage``) and are interleaved on the device."""
        self.layout = layout
        self.planes = planes
        self._staged: dict[int, int] = {}  # block start -> ring slot holding it, between stage and done
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
            per_slot = block_tokens or num_tokens  # a block is staged whole, even where only part is used
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

    def stage(self, start: int, block_tokens: int) -> np.ndarray | None:
        """On the ring path, a slot to decode the block starting at ``start`` into, in wire order: a uint8
        view whose C-order elements are the stored order's bytes and whose last axis is the element size
        (what ``kvsnap.format.codec.decode_into`` fills); ``done`` ships it. None off the ring path."""
        if self.ring is None:
            return None
        itemsize = self.source_dtype.itemsize
        size = block_tokens * self.source_bytes_per_token
        slot = self.ring.acquire()
        self._staged[start] = slot
        wire = self.ring.host_bytes(slot)[:size]
        n = size // itemsize
        return wire.reshape(itemsize, n).T if self.planes else wire.reshape(n, itemsize)

    def done(self, start: int, block_tokens: int, ok: bool = True) -> None:
        """The block staged at ``start`` is decoded (``ok``): copy it to the device and put it in place
        there; else give its slot back."""
        slot = self._staged.pop(start, None)
        if slot is None:
            return
        if not ok:
            self.ring.release(slot)
            return
        L, H, D = self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim
        use = max(0, min(block_tokens, self.num_tokens - start))
        size = block_tokens * self.source_bytes_per_token
        dst = self.buf[:, :, :, start : start + use]

        def place(wire: torch.Tensor) -> None:
            # wire: [size] uint8 on the device, in stored order.
            itemsize = self.source_dtype.itemsize
            if self.planes:
                wire = wire.view(itemsize, size // itemsize).t().contiguous()  # the byte-plane interleave
            values = wire.view(-1).view(self.source_dtype).view(L, 2, H, block_tokens, D)
            dst.copy_(values[:, :, :, :use])

        self.ring.ship(slot, size, place if use else None)

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

        self.device_bytes: list[torch.Tensor | None] = [None] * len(self.buffers)  # wire order, on the device

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def acquire(self) -> int:
        """A free slot, once its previous copy is done (blocks while every slot is in flight)."""
        i = self.free.get()
        if self.events[i] is not None:
            self.events[i].synchronize()
        return i

    def release(self, i: int) -> None:
        self.free.put(i)

    def host_bytes(self, i: int) -> np.ndarray:
        """Slot ``i``'s host memory as flat uint8 numpy (written by a decode thread)."""
        return self.buffers[i].view(-1).view(torch.uint8).numpy()

    def ship(self, i: int, size: int, place) -> None:
        """Copy the first ``size`` bytes of slot ``i`` to the device without waiting, then run
        ``place(device_bytes)`` after it on the same stream; the slot is free once both are done."""
        try:
            if place is None:
                return
            host = self.buffers[i].view(-1).view(torch.uint8)[:size]
            if self.stream is None:
                place(host)
                return
            on_device = self.device_bytes[i]
            if on_device is None:
                on_device = self.device_bytes[i] = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
            with torch.cuda.stream(self.stream):
                on_device[:size].copy_(host, non_blocking=self.pinned)
                place(on_device[:size])
                event = torch.cuda.Event()
                event.record(self.stream)
            self.events[i] = event
        finally:
            self.free.put(i)

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
    restorer = KVTransfer(layout, num_tokens, device, capacity)
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
