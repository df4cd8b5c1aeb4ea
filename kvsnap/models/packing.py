"""Linear weights reordered once into oneDNN's blocked layout, for a CPU process that runs many forwards.

Why: on this repo's 2-core AVX2 VM a 32-token suffix forward of the default model spends 40-70% of
its time in ``aten::mm``, and oneDNN's matmul over weights packed ahead of time runs the same
products 1.2-1.5x faster (``benchmarks/llamacpp.py`` measures the whole forward both ways), and a
one-row product (the lm_head, a decode step) on every core where ``F.linear`` uses one. The
packing is a copy of every linear weight and takes a moment once, so
it pays in a process that runs many forwards (``kvsnap chat``, ``serve``, ``run --batch``, a
library user calling ``start``), not in a one-shot ``kvsnap run`` whose start is what the user waits for.

The packed products are not bit-equal to ``F.linear``'s (oneDNN sums in another order: logits agree
to ~1e-5), so a model's forwards either all use them or none do: ``start`` packs every layer in a
background thread and sets them all at once, and the model's forward waits for that thread before
it runs (``NativeCausalLM.forward``). Only the native forward's float32 weights on the CPU are packed,
and its bfloat16 ones (``--dtype bfloat16``) where the CPU has bfloat16 instructions: on AMX
oneDNN's packed bfloat16 product of a 32-row suffix is ~3x the packed float32 one's speed;
a failure anywhere (an op this torch build lacks, a result that disagrees with ``F.linear``) leaves the
model as it was, with the reason in ``error``. ``KVSNAP_PACK=0`` turns packing off. The packed copy
is new memory (a cast model holds its weights in RAM too), so it is bounded (``MAX_PACKED_BYTES``). It
is of the weights as they are when packing starts: pack a model once it is loaded and placed, never
one whose weights will change (a model moved, cast or loaded in place since runs its own weights, and
drops the stale copy: ``Source``).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch
import torch.nn.functional as F

from kvsnap import limits

ENABLED = os.environ.get("KVSNAP_PACK", "1") != "0"
# Whether one-row products (a decode step; the lm_head, which every forward runs on one row) use the packed
# weights: "auto" times both once per packing, "packed" or "plain" say so. Packing makes a chunk's
# products faster on every CPU measured, but a one-row product is a matrix-vector product, bound by
# memory: oneDNN's packed one ran 1.4x slower than F.linear on a Xeon and faster on an AMD EPYC.
ONE_ROW = os.environ.get("KVSNAP_PACK_ONE_ROW", "auto")
ONE_ROW_REPEATS = 7  # timed rounds per choice, alternating; the fastest of each is compared
STARTING = threading.Lock()  # two threads starting one model's packing start one
# The budget also bounds the reorder a first forward waits on.
MAX_PACKED_BYTES = int(os.environ.get("KVSNAP_PACK_BYTES") or 0) or limits.memory_budget()


def unsupported_reason(model: Any) -> str | None:
    """Why ``model``'s weights are not packed (None: they can be)."""
    if not ENABLED:
        return "KVSNAP_PACK=0"
    if not hasattr(model, "packable_linears"):
        return "not the native forward"
    if getattr(model, "quantization", "none") != "none":
        return "the weights are quantized (kvsnap.models.quantize runs them)"
    weight = model.lm_head.weight
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return "packs float32 or bfloat16 weights on the CPU only"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this torch build has no oneDNN linear"
    if weight.dtype == torch.bfloat16 and not _native_bf16():
        return "this CPU has no bfloat16 instructions (AVX512-BF16 or AMX) for oneDNN"
    size = _bytes(model.packable_linears())
    if size > MAX_PACKED_BYTES:
        return f"a packed copy of {size / 2**30:.1f} GiB is over the {MAX_PACKED_BYTES / 2**30:.1f} GiB allowed"
    return None


def _native_bf16() -> bool:
    # Without them oneDNN emulates bfloat16 (4x slower than float32 on an AVX2 CPU): nothing to win.
    # (torch.ops.mkldnn._is_mkldnn_bf16_supported says True for any AVX-512 CPU, emulation included.)
    probes = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(probe is not None and probe() for probe in probes)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` over the weight ``pack`` made."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Source:
    """The weight a packed copy was made from, as it was: a cast or a move gives the parameter other
    memory (``model.to`` swaps ``param.data``), an in-place load bumps its version. The memory is held,
    so no later allocation can take its address while the copy may be used."""

    def __init__(self, weight: torch.Tensor):
        self._held = weight.detach()  # shares the storage and the version counter
        self._version = weight._version

    def matches(self, weight: torch.Tensor) -> bool:
        return weight.data_ptr() == self._held.data_ptr() and weight._version == self._version


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight)


class Packing:
    """One model's packing, running in a background thread; ``wait`` returns once it is over."""

    def __init__(self, model: Any):
        self.error: str | None = None
        self.done = False
        # What the one-row products run over (``ONE_ROW``), once done: the layers' and the lm_head's.
        self.one_row_packed: tuple[bool, bool] | None = None
        self._thread = threading.Thread(target=self._run, args=(model,), name="kvsnap-pack", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        self._thread.join()

    def _run(self, model: Any) -> None:
        from concurrent.futures import ThreadPoolExecutor

        try:
            linears = list(model.packable_linears())
            _check(linears[0])
            # Two threads: a reorder runs mostly on one core.
            with ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
                packed = list(pool.map(lambda m: pack(m.weight), linears))
            # A decode step's products: the first layer's (every layer has its shapes), timed both ways.
            in_first = set(model.model.layers[0].modules())
            first = [(m, w) for m, w in zip(linears, packed) if m in in_first]
            layers_one_row = _one_row_packed(first)
            # The lm_head too, though it may be the tied embedding (a copy), where its one-row product
            # runs faster packed (the engine runs it on the last row alone: F.linear on one core, oneDNN
            # on all of them, ran faster on an AMD EPYC). Only within the budget: the layers gain more,
            # so a model with room for them alone packs them alone.
            head_one_row = False
            if _bytes([*linears, model.lm_head]) <= MAX_PACKED_BYTES:
                head = pack(model.lm_head.weight)
                head_one_row = _one_row_packed([(model.lm_head, head)])
                if head_one_row:
                    linears.append(model.lm_head)
                    packed.append(head)
        except Exception as exc:  # noqa: BLE001  (any failure leaves the model unpacked, and says why)
            self.error = f"{type(exc).__name__}: {exc}"
            return
        for module, weight in zip(linears, packed):  # all at once: no forward sees a mix
            module.packed_of = Source(module.weight)
            module.packed = weight
            module.packed_one_row = layers_one_row or module is model.lm_head
        self.one_row_packed = (layers_one_row, head_one_row)
        self.done = True


def _one_row_packed(pairs: list[tuple[Any, torch.Tensor]]) -> bool:
    """Whether one-row products over these (module, packed weight) pairs run faster packed (``ONE_ROW``)."""
    if ONE_ROW in ("packed", "plain"):
        return ONE_ROW == "packed"
    best = {True: float("inf"), False: float("inf")}
    with torch.inference_mode():
        rows = {m: torch.randn(1, m.weight.shape[1]).to(m.weight.dtype) for m, _ in pairs}
        for i in range(ONE_ROW_REPEATS + 1):  # a first, untimed round: caches and thread pools
            for use_packed in (True, False) if i % 2 else (False, True):
                t0 = time.perf_counter()
                for m, w in pairs:
                    _ = linear(rows[m], w, m.bias) if use_packed else F.linear(rows[m], m.weight, m.bias)
                if i:
                    best[use_packed] = min(best[use_packed], time.perf_counter() - t0)
    return best[True] < best[False]


def _bytes(linears: list[Any]) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in linears)


def _check(module: Any) -> None:
    # The kernel must give F.linear's result; a build where it does not keeps F.linear.
    weight = module.weight
    x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    with torch.inference_mode():
        want = F.linear(x, weight, module.bias).float()
        got = linear(x, pack(weight), module.bias).float()
    # bfloat16 keeps 8 bits of mantissa: two summation orders may round a sum apart by a few of its ulps.
    rtol, atol = (1e-4, 1e-5) if weight.dtype == torch.float32 else (2e-2, 2e-2 * float(want.abs().max()))
    if got.shape != want.shape or not torch.allclose(got, want, rtol=rtol, atol=atol):
        raise RuntimeError("packed linear disagrees with F.linear")
