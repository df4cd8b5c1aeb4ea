"""Weight-only quantized linears and embeddings, int8 and int4, on kvsnap's kernel or the ones torch ships.

Why: a GGUF is dequantized into a float32 folder, so a 98 MB Q4_1 file runs as 517 MB of weights and a
4-5 GB 8B file would need 32 GB. Quantized at load, one linear at a time (each float weight is released
as soon as its quantized copy exists), the weights stay near the GGUF's own size.

- ``int8``: on kvsnap's kernel (``kvsnap.models.qkernel``), GGUF's Q8_0: a float16 scale per group of 32
  inputs (symmetric), so a Q8_0 file's codes and scales are found again exactly. On torch's kernels one
  scale per output channel, ``torch.ops.aten._weight_int8pack_mm``.
- ``int4``: groups of ``GROUP_SIZE`` inputs, a scale and a minimum per group (asymmetric, GGUF's Q4_1); on
  torch's kernels ``_weight_int4pack_mm_for_cpu`` over ``_convert_weight_to_int4pack_for_cpu``'s layout. A
  linear whose input width is not a multiple of the group size is kept in int8, and so is one whose output
  width torch's packer cannot take (``TORCH_INT4_ROWS``) where torch's kernel would run it.
- The embedding, and the lm_head (tied to it or not), are int8 under both, in the layout of their kernel:
  the lm_head decides every token, and int8 costs it little memory next to the layers.

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
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvsnap.errors import ConfigError, UnsupportedModelError
from kvsnap.models import exact as invariant
from kvsnap.models import qkernel
from kvsnap.models.weight_codes import ROWS_AT_ONCE, int4_groups, int8_groups, int8_rows
from kvsnap.quantization import KERNEL_SUFFIX

GROUP_SIZE = 32  # GGUF's Q4 block; group 64 measured worse perplexity for a few % less memory
COMPUTE_DTYPE = torch.bfloat16
TORCH_INT4_ROWS = 16  # torch's int4 packer takes output widths in multiples of this only


def kernel_for(device: torch.device, in_features: int) -> bool:
    """Whether a linear of this input width on ``device`` runs on kvsnap's own kernel (``qkernel``)."""
    return device.type == "cpu" and in_features % qkernel.GROUP == 0 and qkernel.library() is not None


class QuantizedLinear(nn.Module):
    """A linear layer over int8 or int4 weights; ``forward(x, exact)`` as ``native.Linear``'s.

    ``kernel``: ``a16`` where kvsnap's own kernel runs it (activations quantized to 16 bits in groups, int4
    as codes + float16 scale and min per group, int8 as codes + float16 scale per group), else ``bf16``
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
            q, scales = int8_groups(weight) if self.kernel == "a16" else int8_rows(weight)
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
    def from_codes(
        cls,
        tensors: dict[str, torch.Tensor | None],
        *,
        bits: int,
        group: int,
        kernel: str,
        shape: tuple[int, int],
    ) -> QuantizedLinear:
        """A linear over codes made earlier (``qweight``, ``scales``, ``mins``, ``bias`` in ``tensors``, as
        ``expected_shapes`` lays them out): nothing is quantized, and the tensors are held as they are
        (views of a mapped file, say). ``shape``: (out_features, in_features)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.out_features, self.in_features = shape
        self.bits, self.group, self.kernel, self.q4 = bits, group, kernel, None
        bias = tensors.get("bias")
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.register_buffer("qweight", tensors["qweight"])
        self.register_buffer("scales", tensors["scales"])
        if tensors.get("mins") is not None:
            self.register_buffer("mins", tensors["mins"])
        else:
            self.mins = None
        return self

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
        if self.bits == 8 and self.kernel == "a16":
            d = self.scales.float().repeat_interleave(qkernel.GROUP, dim=1)
            return (self.qweight.float() * d).to(dtype)
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


def expected_shapes(bits: int, kernel: str, out_features: int, in_features: int) -> dict[str, tuple]:
    """``{name: (dtype, shape)}`` of the tensors a ``QuantizedLinear`` on kvsnap's kernel (``a16``) holds:
    what a file of its codes must hold to be taken for it."""
    if kernel != "a16":
        raise ValueError(f"no file layout for kernel {kernel!r}")
    groups = (out_features, in_features // qkernel.GROUP)
    if bits == 8:
        return {"qweight": (torch.int8, (out_features, in_features)), "scales": (torch.float16, groups)}
    return {
        "qweight": (torch.uint8, (out_features, in_features // 2)),
        "scales": (torch.float16, groups),
        "mins": (torch.float16, groups),
    }


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
    """An embedding table in int8 (a scale per group of 32 on kvsnap's kernel, else per row); a lookup
    dequantizes only the rows it takes.

    ``embed_scale``: the factor a scaled embedding (Gemma 2/3's ``*ScaledWordEmbedding``) multiplies its rows
    by, in the model's dtype as the original does; it stays out of the codes, so a tied lm_head shares them."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, embed_scale: torch.Tensor | None = None):
        super().__init__()
        self.kernel = "a16" if kernel_for(weight.device, weight.shape[1]) else "bf16"  # as a tied lm_head's
        q, scales = int8_groups(weight) if self.kernel == "a16" else int8_rows(weight)
        self.register_buffer("qweight", q)  # [vocab, hidden]
        # a16: float16 [vocab, hidden / 32] (Q8_0's layout); bf16: [vocab], torch's int8 product's
        self.register_buffer("scales", scales if self.kernel == "a16" else scales.to(COMPUTE_DTYPE))
        self.dtype = dtype
        scale = None if embed_scale is None else embed_scale.detach().to(dtype).clone()
        self.register_buffer("embed_scale", scale, persistent=False)

    @classmethod
    def from_codes(
        cls, qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, kernel: str, embed_scale=None
    ) -> QuantizedEmbedding:
        """An embedding over codes made earlier (int8 ``qweight`` [vocab, hidden], ``scales`` [vocab])."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.kernel, self.dtype = kernel, dtype
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("embed_scale", embed_scale, persistent=False)
        return self

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.qweight).to(self.dtype)
        if self.kernel == "a16":  # a scale per group of 32 (Q8_0's layout)
            rows = rows * self.scales[ids].to(self.dtype).repeat_interleave(qkernel.GROUP, dim=-1)
        else:
            rows = rows * self.scales[ids].to(self.dtype)[..., None]
        return rows if self.embed_scale is None else rows * self.embed_scale


def embedding_scale(module: nn.Module) -> torch.Tensor | None:
    """The factor ``module``'s lookup multiplies its rows by (None: a plain lookup), for the quantized embedding
    to keep. Raises ``UnsupportedModelError`` for an embedding whose lookup does more than a quantized one can
    reproduce: a model run without it would answer garbage, silently."""
    kind = type(module)
    if kind.forward is nn.Embedding.forward or getattr(kind, "plain_lookup", False):  # torch's, or kvsnap's own
        return None
    scale = getattr(module, "embed_scale", None)
    if kind.__name__.endswith("ScaledWordEmbedding") and isinstance(scale, torch.Tensor) and scale.numel() == 1:
        return scale  # lookup * embed_scale, as Gemma 2/3's forward computes it
    raise UnsupportedModelError(
        f"cannot quantize this model: its embedding ({kind.__name__}) does more than a table lookup; "
        "run it with --quantize none"
    )


def kv_dtype(mode: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype: a quantized model's on the CPU is float16 under float32 activations, as llama.cpp
    keeps it (half the bytes for the attention to read and a snapshot to hold); any other model's, its own."""
    return torch.float16 if mode != "none" and device.type == "cpu" and dtype == torch.float32 else dtype


def check_linear(module: nn.Module, name: str) -> None:
    """Refuse a linear layer whose forward does more than ``x @ W.T + b``: its quantized product would drop it."""
    kind = type(module)
    if isinstance(module, nn.Linear) and kind.forward is not nn.Linear.forward:
        raise UnsupportedModelError(
            f"cannot quantize this model: its layer {name} ({kind.__name__}) computes more than a linear product; "
            "run it with --quantize none"
        )


# -- a model, one linear at a time -------------------------------------------------------------------


def apply(model: Any, mode: str, dtype: torch.dtype, given: dict[str, dict] | None = None) -> None:
    """Quantize ``model``'s linear layers (``mode``: ``int8`` or ``int4``), its embedding and lm_head in
    int8, in place, one layer at a time: each float weight is dropped once its codes exist. ``given``: int4
    codes on kvsnap's kernel made elsewhere, by module name (``kvsnap.models.gguf_codes``), used as they are."""
    if mode not in ("int8", "int4"):
        raise ConfigError(f"cannot quantize to {mode!r} (int8, int4)")
    bits = 4 if mode == "int4" else 8
    embed_owner, embed_name = _owner(model, _embedding_name(model))
    embedding = getattr(embed_owner, embed_name)
    head = model.get_output_embeddings()
    tied = head is not None and getattr(head, "weight", None) is getattr(embedding, "weight", None)
    scale = embedding_scale(embedding)  # refuses before any layer is replaced
    linears = [(name, m) for name, m in model.named_modules() if m is not head and _is_linear(m)]
    for name, module in linears + ([] if head is None else [("lm_head", head)]):
        check_linear(module, name)
    for name, module in linears:
        owner, attr = _owner(model, name)
        codes, bias = (given or {}).get(name), getattr(module, "bias", None)
        if codes is not None and bits == 4 and kernel_for(module.weight.device, module.weight.shape[1]):
            with_bias = {**codes, "bias": None if bias is None else bias.detach().clone()}
            shape = tuple(module.weight.shape)
            layer = QuantizedLinear.from_codes(with_bias, bits=4, group=GROUP_SIZE, kernel="a16", shape=shape)
        else:
            layer = QuantizedLinear(module.weight, bias, bits)
        setattr(owner, attr, layer)
        module.weight = None  # the float weight goes now, not when the walk ends
    quantized_embedding = QuantizedEmbedding(embedding.weight, dtype, scale)
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
        (isinstance(module, nn.Linear) or getattr(type(module), "plain_product", False))
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


__all__ = ["QuantizedLinear", "QuantizedEmbedding", "apply", "weight_bytes"]
