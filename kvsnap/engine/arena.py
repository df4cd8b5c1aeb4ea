"""KV buffers kept for reuse within a process: a restore or a prefill writes into pages already touched.

A fresh ``[layers, 2, kv_heads, capacity, head_dim]`` buffer costs nothing to allocate but a page fault
per 4 KiB the first time it is written: at a few thousand tokens of context that costs more than
decoding the blocks that fill it (docs/benchmarks.md). So CPU buffers are pooled per process (like
the decode threads): a buffer goes back to the pool by itself when no cache, transfer or array views
it any more, and the next restore, prefill or fresh session of the same shape takes it, pages
already mapped.

Whether a buffer is free is read from the references to it (its storage's use count and its
Python reference count), not from callers remembering to give it back: a cache dropped anywhere
(a session replaced, a failed restore, a serve conversation evicted) frees it, and nothing a live
cache still views is handed out twice. Where torch lacks the use count, nothing is pooled.

CUDA buffers are not pooled: torch's caching allocator already reuses device memory without faults.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass

import numpy as np
import torch

from kvsnap import limits

# KVSNAP_ARENA=0 turns pooling off (every buffer fresh): for measuring what the pool buys.
ENABLED = os.environ.get("KVSNAP_ARENA", "1") != "0"
# Free pooled buffers beyond this are let go (oldest first); a buffer larger than it is never pooled.
MAX_POOLED_BYTES = int(os.environ.get("KVSNAP_ARENA_BYTES") or 0) or limits.memory_budget()

_use_count = getattr(torch._C, "_storage_Use_Count", None)


@dataclass(eq=False)
class _Entry:
    buf: torch.Tensor
    uses: int  # the storage use count when nothing but the pool holds it
    refs: int  # the Python reference count then


_pool: list[_Entry] = []
_lock = threading.Lock()


def _free(entry: _Entry) -> bool:
    # Always the same expressions, so the temporaries they make count the same at every check.
    return _use_count(entry.buf.untyped_storage()._cdata) == entry.uses and sys.getrefcount(entry.buf) == entry.refs


def _fits(entry: _Entry, shape: tuple[int, ...], dtype) -> bool:
    b = entry.buf
    return b.dtype == dtype and b.shape[:3] == shape[:3] and b.shape[4] == shape[4] and b.shape[3] >= shape[3]


def kv_buffer(num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype, device) -> torch.Tensor:
    """A ``[num_layers, 2, num_kv_heads, >= capacity, head_dim]`` buffer; contents undefined.

    The buffer may be longer than asked (a pooled one): callers use ``buf.shape[3]`` as its capacity.
    """
    device = torch.device(device)
    shape = (num_layers, 2, num_kv_heads, capacity, head_dim)
    if _use_count is None or device.type != "cpu" or not ENABLED:
        return torch.empty(shape, dtype=dtype, device=device)
    with _lock:
        best = None
        for entry in _pool:
            if _fits(entry, shape, dtype) and (best is None or entry.buf.shape[3] < best.buf.shape[3]) and _free(entry):
                best = entry
        if best is not None:
            _pool.remove(best)
            _pool.append(best)  # most recently used last: eviction takes the oldest
            return best.buf
        # Room up to the next power of two: untouched pages cost nothing, a cache that grows into
        # them never regrows (copying its history), and pooled buffers come in few sizes to match.
        rounded = 1 << max(8, (capacity - 1).bit_length())
        per_token = _bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)
        if rounded * per_token <= MAX_POOLED_BYTES:
            shape = (num_layers, 2, num_kv_heads, rounded, head_dim)
        buf = torch.empty(shape, dtype=dtype, device=device)
        _enlist(buf)
        return buf


def warm(num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype) -> bool:
    """Pool a CPU buffer for ``capacity`` tokens with its pages touched now (a process's context size,
    ``--ctx-size``): the next restore, prefill or fresh session takes it, no page faults on its path.
    False where it would not be pooled (pooling off, or larger than the pool's budget)."""
    per_token = _bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)
    if _use_count is None or not ENABLED or capacity * per_token > MAX_POOLED_BYTES:
        return False
    buf = kv_buffer(num_layers, num_kv_heads, head_dim, capacity, dtype, "cpu")
    buf.view(-1).view(torch.uint8).zero_()
    with _lock:
        pooled = any(entry.buf is buf for entry in _pool)
    del buf
    return pooled


def _bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype) -> int:
    return num_layers * 2 * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def adopt(raw: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """``raw`` (uint8 ``[layers, 2, kv_heads, capacity, head_dim * itemsize]``, filled elsewhere: a
    prefetch) as a ``dtype`` KV buffer, pooled like the others once its cache lets it go."""
    buf = torch.from_numpy(raw).view(dtype)
    if _use_count is not None and ENABLED:
        with _lock:
            _enlist(buf)
    return buf


def _enlist(buf: torch.Tensor) -> None:
    """Pool a new buffer (lock held), if it fits the budget. Its caller holds it in one local name."""
    nbytes = buf.numel() * buf.element_size()
    if nbytes > MAX_POOLED_BYTES:
        return
    _make_room(nbytes)
    entry = _Entry(buf, 0, 0)
    entry.uses = _use_count(entry.buf.untyped_storage()._cdata)
    # Less the caller's name and this function's: once both are gone, only the entry holds it.
    entry.refs = sys.getrefcount(entry.buf) - 2
    _pool.append(entry)


def _make_room(nbytes: int) -> None:
    total = sum(e.buf.numel() * e.buf.element_size() for e in _pool)
    for entry in list(_pool):
        if total + nbytes <= MAX_POOLED_BYTES:
            break
        if _free(entry):
            _pool.remove(entry)
            total -= entry.buf.numel() * entry.buf.element_size()
    # Buffers still in use stay listed; they count until they are free and let go.


def pooled_bytes() -> tuple[int, int]:
    """(bytes pooled, bytes of them free now)."""
    with _lock:
        sizes = [(e.buf.numel() * e.buf.element_size(), _free(e)) for e in _pool]
    return sum(s for s, _ in sizes), sum(s for s, free in sizes if free)


def clear() -> None:
    """Let every pooled buffer go (those in use live on with their caches)."""
    with _lock:
        _pool.clear()
