"""Weight-only quantized linears: int8 per output channel, int4 in groups, on the kernels torch ships.

Why: a GGUF is dequantized into a float32 folder, so a 98 MB Q4_1 file runs as 517 MB of weights and a
4-5 GB 8B file would need 32 GB. Quantized at load, one linear at a time (each float weight is released
as soon as its quantized copy exists), the weights stay near the GGUF's own size.

- ``int8``: one scale per output channel (symmetric), ``torch.ops.aten._weight_int8pack_mm``.
- ``int4``: groups of ``GROUP_SIZE`` inputs, a scale and a zero per group (asymmetric, like GGUF's Q4_1),
  ``_weight_int4pack_mm_for_cpu`` over ``_convert_weight_to_int4pack_for_cpu``'s layout. A linear whose
  input width is not a multiple of the group size is kept in int8, and so is one whose output width
  torch's packer cannot take (``TORCH_INT4_ROWS``) where torch's kernel would run it.
- The embedding, and the lm_head (tied to it or not), are int8 per row under both: the lm_head decides
  every token, and int8 costs it little memory next to the layers.

The products run in bfloat16 activations, whatever the model's dtype: torch's float32 paths of these
kernels are reference loops (10-30x slower than the bfloat16 ones on the 2-core AVX2 VM); the result is
cast back, so the rest of the forward keeps its dtype. On a GPU (a transformers model), the weight is
dequantized per product instead: correct everywhere, small in memory, not tuned for speed.

On torch's CPU kernels the native forward always runs batch-invariant (``runs_exact``), so a resume
equals the cold run as on kvsnap's kernel; there it costs what ``--exact`` costs (``benchmarks/exact.py``).

A quantized model is another model: its KV differs from the float one's, so the quantization is part of
the fingerprint (``kvsnap.models.fingerprint``), and a snapshot made with one is refused by the other.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvsnap.errors import ConfigError
from kvsnap.models import exact as invariant
from kvsnap.models import qkernel
from kvsnap.quantization import KERNEL_SUFFIX

MODES = ("none", "int8", "int4", "auto")
GROUP_SIZE = 32  # GGUF's Q4 block; group 64 measured worse perplexity for a few % less memory
COMPUTE_DTYPE = torch.bfloat16
TORCH_INT4_ROWS = 16  # torch's int4 packer takes output widths in multiples of this only


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ConfigError(f"unknown quantization {mode!r} ({', '.join(MODES)})")
    return mode


def resolve(mode: str, gguf_class: str | None) -> str:
    """The quantization a load applies: ``auto`` keeps a GGUF's class (``gguf_class``), else none."""
    check_mode(mode)
    if mode == "auto":
        return gguf_class or "none"
    return mode


def class_of_gguf_types(type_names: list[str]) -> str:
    """``int4``, ``int8`` or ``none`` for a GGUF whose layer weights are stored in ``type_names``
    (GGML type names: ``Q4_1``, ``Q8_0``, ``F16``, ...): the class most of them fall in."""
    counts = {"int4": 0, "int8": 0, "none": 0}
    for name in type_names:
        counts[_class_of_type(name)] += 1
    return max(counts, key=lambda k: (counts[k], k == "none"))


def _class_of_type(name: str) -> str:
    name = name.upper()
    if name in ("F32", "F16", "BF16", "F64"):
        return "none"
    if name.startswith(("Q6", "Q8")):
        return "int8"
    return "int4"  # Q2-Q5, IQ*, TQ*: 5 bits or fewer


def gguf_class(path: Path) -> str | None:
    """The class of the GGUF file's layer weights (None: not readable as a GGUF)."""
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        names = [t.tensor_type.name for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    except Exception:
        return None
    return class_of_gguf_types(names) if names else None


# -- quantizing ---------------------------------------------------------------------------------------


ROWS_AT_ONCE = 4096  # rows quantized per step: float temporaries stay a few MB whatever the matrix


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)``: ``weight ~= q * scales[:, None]``, one symmetric scale per row."""
    q = torch.empty(weight.shape, dtype=torch.int8)  # [N, K]
    scales = torch.empty(weight.shape[0], dtype=torch.float32)  # [N]
    for start in range(0, weight.shape[0], ROWS_AT_ONCE):
        w = weight[start : start + ROWS_AT_ONCE].detach().float()
        s = (w.abs().amax(dim=1) / 127).clamp(min=1e-10)
        q[start : start + ROWS_AT_ONCE] = torch.round(w / s[:, None]).clamp_(-127, 127)
        scales[start : start + ROWS_AT_ONCE] = s
    return q.to(weight.device), scales.to(weight.device)


def int4_groups(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales_and_zeros)``: ``q`` int32 in 0..15 [N, K]; ``weight ~= (q - 8) * scale + zero`` per group
    of ``group`` inputs, the scales and zeros as ``[K / group, N, 2]`` (the kernel's layout)."""
    n, k = weight.shape
    q = torch.empty(n, k, dtype=torch.int32)
    pairs = torch.empty(n, k // group, 2, dtype=torch.float32)
    for start in range(0, n, ROWS_AT_ONCE):
        grouped = weight[start : start + ROWS_AT_ONCE].detach().float().reshape(-1, k // group, group)
        low, high = grouped.amin(dim=2, keepdim=True), grouped.amax(dim=2, keepdim=True)
        scales = ((high - low) / 15).clamp(min=1e-10)
        q[start : start + ROWS_AT_ONCE] = ((grouped - low) / scales).round_().clamp_(0, 15).reshape(-1, k)
        pairs[start : start + ROWS_AT_ONCE] = torch.cat([scales, low + scales * 8], dim=2)
    return q.to(weight.device), pairs.transpose(0, 1).contiguous().to(weight.device)  # [N, K], [K/g, N, 2]


def int4_pairs(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, d, mins)``: ``weight ~= q * d + mins`` per group of ``group`` inputs (GGUF's Q4_1), ``q`` in 0..15
    int32 [N, K], ``d`` and ``mins`` float16 [N, K / group]: kvsnap's own kernel's layout
    (``kvsnap.models.qkernel``). From a Q4_1 file's dequantized weights this finds the file's own codes."""
    n, k = weight.shape
    q = torch.empty(n, k, dtype=torch.int32)
    d = torch.empty(n, k // group, dtype=torch.float16)
    mins = torch.empty_like(d)
    for start in range(0, n, ROWS_AT_ONCE):
        grouped = weight[start : start + ROWS_AT_ONCE].detach().float().reshape(-1, k // group, group)
        low, high = grouped.amin(dim=2), grouped.amax(dim=2)
        scale = ((high - low) / 15).half().clamp(min=torch.finfo(torch.float16).tiny).float()
        low = low.half()
        codes = (grouped - low.float()[..., None]) / scale[..., None]
        q[start : start + ROWS_AT_ONCE] = codes.round_().clamp_(0, 15).reshape(-1, k)
        d[start : start + ROWS_AT_ONCE], mins[start : start + ROWS_AT_ONCE] = scale.half(), low
    return q, d, mins


def kernel_for(device: torch.device, in_features: int) -> bool:
    """Whether a linear of this input width on ``device`` runs on kvsnap's own kernel (``qkernel``)."""
    return device.type == "cpu" and in_features % qkernel.GROUP == 0 and qkernel.library() is not None


class QuantizedLinear(nn.Module):
    """A linear layer over int8 or int4 weights; ``forward(x, exact)`` as ``native.Linear``'s.

    ``kernel``: ``a16`` where kvsnap's own kernel runs it (activations quantized to 16 bits in groups, int4
    as codes + float16 scale and min per group, int8 with a float32 scale per row), else ``bf16``
    (torch's kernels over their own layouts, bfloat16 activations)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, bits: int, group: int = GROUP_SIZE):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.kernel = "a16" if group == qkernel.GROUP and kernel_for(weight.device, self.in_features) else "bf16"
        if bits == 4 and self.in_features % group:
            bits = 8  # the kernels take whole groups only
        torch_packed = self.kernel == "bf16" and weight.device.type == "cpu"
        if bits == 4 and torch_packed and self.out_features % TORCH_INT4_ROWS:
            bits = 8  # torch's packer refuses it (a traceback, not a model)
        self.bits, self.group = bits, group
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.q4 = None  # the GPU path's plain codes
        if bits == 8:
            q, scales = int8_rows(weight)
            self.register_buffer("qweight", q)
            self.register_buffer("scales", scales if self.kernel == "a16" else scales.to(COMPUTE_DTYPE))
            self.mins = None
        elif self.kernel == "a16":
            codes, d, mins = qkernel.quantize_q4(weight, ROWS_AT_ONCE)  # int4_pairs + pack_q4, in C
            self.register_buffer("qweight", codes)
            self.register_buffer("scales", d)
            self.register_buffer("mins", mins)
        else:
            q, scales_and_zeros = int4_groups(weight, group)
            self.register_buffer("qweight", _pack_int4(q, weight.device))
            self.register_buffer("scales", scales_and_zeros.to(COMPUTE_DTYPE))
            self.mins = None
            self.q4 = q.to(torch.uint8) if weight.device.type != "cpu" else None

    @classmethod
    def sharing(cls, embedding: QuantizedEmbedding) -> QuantizedLinear:
        """An int8 lm_head over a quantized embedding's own tensors (a tied output layer)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.out_features, self.in_features = embedding.qweight.shape
        self.bits, self.group, self.bias, self.q4, self.mins = 8, GROUP_SIZE, None, None, None
        self.kernel = embedding.kernel
        self.qweight, self.scales = embedding.qweight, embedding.scales  # plain attributes: one copy
        return self

    def forward(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        if not exact:
            return self._product(x)
        return invariant.in_row_tiles(x, self._product)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.kernel == "a16":
            rows = qkernel.rows_of(x)  # [M, K] float32
            if self.bits == 8:
                out = qkernel.matmul_q8(rows, self.qweight, self.scales)
            else:
                out = qkernel.matmul_q4(rows, self.qweight, self.scales, self.mins)
        else:
            rows = x.reshape(-1, shape[-1]).to(COMPUTE_DTYPE)  # [M, K]
            if rows.device.type != "cpu":
                out = F.linear(rows, self.dequantized(COMPUTE_DTYPE))
            elif self.bits == 8:
                out = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales)
            else:
                out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.qweight, self.group, self.scales)
        out = out.to(x.dtype).reshape(*shape[:-1], self.out_features)  # [..., N]
        return out if self.bias is None else out + self.bias.to(x.dtype)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight these codes stand for, [N, K] (the GPU path; tests)."""
        if self.bits == 8:
            return (self.qweight.to(dtype) * self.scales.to(dtype)[:, None]).to(dtype)
        if self.kernel == "a16":
            d = self.scales.float().repeat_interleave(self.group, dim=1)
            mins = self.mins.float().repeat_interleave(self.group, dim=1)
            return (qkernel.unpack_q4(self.qweight).float() * d + mins).to(dtype)
        codes = self.q4 if self.q4 is not None else _unpack_int4(self)
        scales = self.scales[..., 0].t().repeat_interleave(self.group, dim=1).float()
        zeros = self.scales[..., 1].t().repeat_interleave(self.group, dim=1).float()
        return ((codes.float() - 8) * scales + zeros).to(dtype)

    def nbytes(self) -> int:
        extra = [t for t in (self.bias, self.mins) if t is not None]
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, *extra))


def _pack_int4(q: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)  # [N, K/2] uint8, the kernel's order
    return torch.empty(0, dtype=torch.uint8, device=device)  # the GPU path keeps plain codes (q4)


@functools.cache
def packs_concatenate(widths: tuple[int, ...]) -> bool:
    """Whether torch's int4 packing of parts ``widths`` outputs wide, laid end to end along the outputs, is
    the packing of their codes laid end to end: it packs the outputs in blocks (32 or 64 by the CPU), so
    a part that ends inside a block leaves the next part's codes where the kernel does not read them.
    Probed on random codes (the layout does not depend on the input width), not read from torch's source."""
    if any(w % TORCH_INT4_ROWS for w in widths):
        return False
    cpu = torch.device("cpu")
    seeded = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (sum(widths), GROUP_SIZE), dtype=torch.int32, generator=seeded)
    parts = torch.cat([_pack_int4(part.contiguous(), cpu) for part in codes.split(list(widths))])
    return torch.equal(parts, _pack_int4(codes, cpu))


def _unpack_int4(layer: QuantizedLinear) -> torch.Tensor:
    # The packed layout is the kernel's own: read the codes back through it, one identity row per input.
    eye = torch.eye(layer.in_features, dtype=COMPUTE_DTYPE)
    ones = torch.ones_like(layer.scales)
    ones[..., 1] = 0
    raw = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, layer.qweight, layer.group, ones)  # [K, N] = q - 8
    return (raw.float().t() + 8).round().to(torch.uint8)


class QuantizedEmbedding(nn.Module):
    """An embedding table in int8 per row; a lookup dequantizes only the rows it takes."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        q, scales = int8_rows(weight)
        self.kernel = "a16" if kernel_for(weight.device, weight.shape[1]) else "bf16"  # as a tied lm_head's
        self.register_buffer("qweight", q)  # [vocab, hidden]
        self.register_buffer("scales", scales if self.kernel == "a16" else scales.to(COMPUTE_DTYPE))  # [vocab]
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.qweight).to(self.dtype)
        return rows * self.scales[ids].to(self.dtype)[..., None]


# -- a model, one linear at a time -------------------------------------------------------------------


def apply(model: Any, mode: str, dtype: torch.dtype) -> None:
    """Quantize ``model``'s linear layers (``mode``: ``int8`` or ``int4``), its embedding and lm_head in
    int8, in place, one layer at a time: each float weight is dropped once its codes exist."""
    if mode not in ("int8", "int4"):
        raise ConfigError(f"cannot quantize to {mode!r} (int8, int4)")
    bits = 4 if mode == "int4" else 8
    embed_owner, embed_name = _owner(model, _embedding_name(model))
    embedding = getattr(embed_owner, embed_name)
    head = model.get_output_embeddings()
    tied = head is not None and getattr(head, "weight", None) is getattr(embedding, "weight", None)
    for name, module in list(model.named_modules()):
        if module is head or not _is_linear(module):
            continue
        owner, attr = _owner(model, name)
        setattr(owner, attr, QuantizedLinear(module.weight, getattr(module, "bias", None), bits))
        module.weight = None  # the float weight goes now, not when the walk ends
    quantized_embedding = QuantizedEmbedding(embedding.weight, dtype)
    setattr(embed_owner, embed_name, quantized_embedding)
    if head is not None:
        head_owner, head_name = _owner(model, _head_name(model, head))
        new_head = QuantizedLinear.sharing(quantized_embedding) if tied else QuantizedLinear(head.weight, None, 8)
        setattr(head_owner, head_name, new_head)
    for module in model.modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            continue
        for tensor in module.parameters(recurse=False):
            # What stays float (norms) gets memory of its own: a view into a mapped weights file would keep
            # the whole mapping, and every page the quantization read, resident.
            tensor.data = tensor.data.to(dtype).clone()
    kernels = {m.kernel for m in model.modules() if isinstance(m, QuantizedLinear)}
    model.batch_invariant = any(
        m.kernel == "bf16" and m.qweight.device.type == "cpu" for m in model.modules() if isinstance(m, QuantizedLinear)
    )
    # The fingerprint's name of it: torch's bfloat16 products keep the plain name, kvsnap's kernel adds its own.
    names = {frozenset({"a16"}): f"{mode}{KERNEL_SUFFIX}", frozenset({"bf16"}): mode}
    model.quantization = names.get(frozenset(kernels), f"{mode}-mixed")
    return_freed_memory()


def runs_exact(model: Any) -> bool:
    """Whether ``model``'s forwards must all run batch-invariant (``kvsnap.models.exact``) for a token's KV
    not to depend on the chunk it ran in: some product runs on torch's CPU kernels. Those round each
    product's input to bfloat16, so the few ulps a float32 attention differs by between chunk sizes turn
    into whole bfloat16 ulps, and a resume into another answer than the cold run's (kvsnap's kernel
    computes every row alike: no need). Their products are tiled as every exact product is."""
    return bool(getattr(model, "batch_invariant", False))


def return_freed_memory() -> None:
    # The temporaries leave glibc's heap holding freed pages (~30 MB for the default model): give them
    # back, so resident memory is the weights. Elsewhere (no glibc) they are only kept for reuse.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def weight_bytes(model: Any) -> int:
    """Bytes the model's weights hold (shared tensors once), quantized codes and scales included."""
    seen: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        seen[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


def _is_linear(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        (isinstance(module, nn.Linear) or type(module).__name__ == "Linear")
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
    )


def _embedding_name(model: Any) -> str:
    embedding = model.get_input_embeddings()
    return next(name for name, m in model.named_modules() if m is embedding)


def _head_name(model: Any, head: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is head)


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent, _, attr = name.rpartition(".")
    return (model.get_submodule(parent) if parent else model), attr


__all__ = ["MODES", "QuantizedLinear", "QuantizedEmbedding", "apply", "resolve", "weight_bytes"]
