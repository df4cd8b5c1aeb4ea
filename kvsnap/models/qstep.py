"""A quantized layer's decode step in two calls into kvsnap's kernels (``qmatmul.c``).

Why: with the weights in 4 bits, a one-token step of a small model is mostly overhead. Each of its few
hundred torch operators costs 2-30 us on the 2-core VM whatever its size (a 576-wide ``rms_norm`` took
30 us, a one-query attention 110-220 us), about half of a step. Here a layer of a model whose products
all run on kvsnap's kernel (``QuantizedLinear.kernel == "a8"``) runs as:

1. ``kv_step_qkv``: the input norm, the fused q/k/v product, the rotation of q and k;
2. the cache's own ``update`` with the new k and v (the cache stays the only owner of its buffers);
3. ``kv_step_rest``: the attention of the one query over the cache, the output projection and residual,
   the MLP's norm, the fused gate/up product, ``silu(gate) * up``, the down product and residual.

The arithmetic is the layer's (the same norms, rotation, softmax and products), in another order: the
result is within float32 rounding of ``decode_step.layer``'s, not bit for bit (tests/test_qstep.py).
Only float32 activations and caches of the native forward's full-attention layers come here, and only
while every product of the layer is one of kvsnap's kernel; anything else takes ``decode_step.layer``.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import torch

from kvsnap.models import qkernel
from kvsnap.models.quantize import QuantizedLinear

_scratch = threading.local()


class Matrix(ctypes.Structure):
    """``kv_matrix``: one quantized product's tensors, by address."""

    _fields_ = [
        ("bits", ctypes.c_int64),
        ("codes", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("mins", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
    ]


def _matrix(linear: QuantizedLinear, keep: list[torch.Tensor]) -> Matrix:
    bias = None
    if linear.bias is not None:
        bias = linear.bias.detach().float().contiguous()
        keep.append(bias)
    mins = linear.mins.data_ptr() if linear.mins is not None else None
    return Matrix(
        linear.bits, linear.qweight.data_ptr(), linear.scales.data_ptr(), mins,
        bias.data_ptr() if bias is not None else None, linear.out_features, linear.in_features,
    )  # fmt: skip


def _watch(block: Any) -> list[tuple[dict, str, Any, int | None]]:
    """Where each module and tensor of the layer's kernel forward hangs (its dict, its key), what hangs there
    and the tensor's in-place version: anything replaced or written since shows as a change, at the cost
    of a dict lookup per entry (module attribute access costs ~1.6 us a name on the 2-core VM)."""
    attn, mlp = block.self_attn, block.mlp
    watch: list[tuple[dict, str, Any, int | None]] = [(attn.__dict__, n, attn.__dict__[n], None) for n in ("qkv",)]
    watch.append((mlp.__dict__, "gate_up", mlp.__dict__["gate_up"], None))
    for owner, names in ((block, ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")),
                         (attn, ("q_proj", "k_proj", "v_proj", "o_proj")), (mlp, ("gate_proj", "up_proj", "down_proj"))):  # fmt: skip
        watch += [(owner._modules, n, owner._modules[n], None) for n in names]
    for norm in (block.input_layernorm, block.post_attention_layernorm):
        watch.append((norm._parameters, "weight", norm.weight, norm.weight._version))
    for linear in (*attn.__dict__["qkv"].parts, attn.o_proj, *mlp.__dict__["gate_up"].parts, mlp.down_proj):
        for table in (linear._buffers, linear._parameters, linear.__dict__):
            watch += [(table, n, table[n], table[n]._version) for n in ("qweight", "scales", "mins", "bias")
                      if isinstance(table.get(n), torch.Tensor)]  # fmt: skip
    return watch


class LayerStep:
    """The addresses and shapes a layer's kernel forward passes to the kernels, taken once from its modules
    (which it holds, with its tensors, so no address it passes can be freed under it)."""

    def __init__(self, block: Any):
        attn, mlp = block.self_attn, block.mlp
        qkv, gate_up = attn.__dict__["qkv"], mlp.__dict__["gate_up"]
        qkv.refresh()
        gate_up.refresh()
        self.watch = _watch(block)
        self.keep: list[torch.Tensor] = []
        self.qkv = _matrix(qkv.whole[0], self.keep)
        self.o = _matrix(attn.o_proj, self.keep)
        self.gate_up = _matrix(gate_up.whole[0], self.keep)
        self.down = _matrix(mlp.down_proj, self.keep)
        norms = (block.input_layernorm, block.post_attention_layernorm)
        self.norms = [n.weight.detach().float().contiguous() for n in norms]
        self.eps = (float(norms[0].eps), float(norms[1].eps))
        self.head_dim = attn.head_dim
        self.widths = qkv.widths  # q, k, v
        self.hidden, self.inter = attn.o_proj.out_features, mlp.down_proj.in_features
        self.fused = (qkv, gate_up)

    def fresh(self) -> bool:
        for table, name, held, version in self.watch:
            if table.get(name) is not held or (version is not None and held._version != version):
                return False
        return True


def step_for(block: Any, x: torch.Tensor, cache: Any) -> LayerStep | None:
    """The layer's kernel forward, or None where torch's must run it: activations other than float32, more
    than one sequence, no cache, a layer with a window, or a product that is not on kvsnap's kernel."""
    if "qkv" not in block.self_attn.__dict__:  # not quantized on kvsnap's kernel (the float models' way out)
        return None
    if x.dtype != torch.float32 or (x.dim() == 3 and x.shape[0] != 1) or cache is None:
        return None
    if getattr(cache.layers[block.self_attn.index], "window", None) is not None:
        return None
    step = block.__dict__.get("kernel_step")
    if step is None or not step.fresh():
        step = LayerStep(block) if _kernel_layer(block) else None
        block.__dict__["kernel_step"] = step
    return step


def _kernel_layer(block: Any) -> bool:
    attn, mlp = block.self_attn, block.mlp
    fused = attn.__dict__.get("qkv"), mlp.__dict__.get("gate_up")
    if any(f is None or f.whole[0].kernel != "a8" for f in fused):
        return False
    return all(isinstance(m, QuantizedLinear) and m.kernel == "a8" for m in (attn.o_proj, mlp.down_proj)) and all(
        n.weight.dtype == torch.float32 for n in (block.input_layernorm, block.post_attention_layernorm)
    )


def _buffers(size: dict[str, int]) -> dict[str, torch.Tensor]:
    """This thread's scratch tensors, at least ``size`` elements each (the scores grow with the context,
    so they are made twice as large as asked)."""
    held = getattr(_scratch, "held", None)
    if held is None:
        held = _scratch.held = {}
    for name, n in size.items():
        if name not in held or held[name].numel() < n:
            held[name] = torch.empty(
                2 * n if name == "scores" else n, dtype=torch.int8 if name == "xq" else torch.float32
            )
    return held


def run(
    step: LayerStep, attn: Any, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, cache: Any
) -> torch.Tensor:
    """The layer over M new rows: x [..., M, hidden] float32 (one sequence); cos and sin_signed [M, head_dim]
    or [head_dim] for every row. Returns the layer's output, shaped as x."""
    lib = qkernel.library()
    q_width, kv_width, _ = step.widths
    d = step.head_dim
    heads, kv_heads = q_width // d, kv_width // d
    rows = x.reshape(-1, step.hidden).clone()  # updated in place by the second call
    m = rows.shape[0]
    cos = cos.reshape(-1, d).expand(m, d).contiguous()
    sin_signed = sin_signed.reshape(-1, d).expand(m, d).contiguous()
    widest = max(step.hidden, step.inter, q_width)
    held = _buffers({
        "qkv": m * sum(step.widths), "h": m * step.hidden, "attn": m * q_width, "act": m * 2 * step.inter,
        "xq": m * widest, "xd": m * widest // qkernel.GROUP, "xs": m * widest // qkernel.GROUP,
    })  # fmt: skip
    h, xq, xd, xs = held["h"], held["xq"], held["xd"], held["xs"]
    qkv = held["qkv"][: m * sum(step.widths)].view(m, sum(step.widths))
    lib.kv_layer_qkv(
        rows.data_ptr(), m, step.norms[0].data_ptr(), ctypes.c_float(step.eps[0]), step.hidden,
        ctypes.byref(step.qkv), cos.data_ptr(), sin_signed.data_ptr(), heads + kv_heads, d, qkv.data_ptr(),
        h.data_ptr(), xq.data_ptr(), xd.data_ptr(), xs.data_ptr(),
    )  # fmt: skip
    k = qkv[:, q_width : q_width + kv_width].view(m, kv_heads, d).transpose(0, 1).unsqueeze(0)  # [1, kv, m, d]
    v = qkv[:, q_width + kv_width :].view(m, kv_heads, d).transpose(0, 1).unsqueeze(0)
    keys, values = cache.update(k, v, attn.index)  # [1, kv_heads, length, d]
    if keys.stride(3) != 1 or values.stride() != keys.stride():
        keys, values = keys.contiguous(), values.contiguous()
    lib.kv_layer_rest(
        rows.data_ptr(), m, qkv.data_ptr(), qkv.stride(0), keys.data_ptr(), values.data_ptr(), keys.stride(1),
        keys.stride(2), keys.shape[2], ctypes.c_float(attn.scaling), heads, kv_heads, d, ctypes.byref(step.o),
        step.norms[1].data_ptr(), ctypes.c_float(step.eps[1]), ctypes.byref(step.gate_up), ctypes.byref(step.down),
        held["attn"].data_ptr(), h.data_ptr(), held["act"].data_ptr(), xq.data_ptr(), xd.data_ptr(), xs.data_ptr(),
    )  # fmt: skip
    return rows.view(x.shape)
