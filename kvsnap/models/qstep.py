"""The kernel forward: quantized layers run whole in kvsnap's kernel (``qmatmul.c``), row by row.

Why: with the weights in 4 bits, a one-token step of a small model is mostly overhead. Each of its few
hundred torch operators costs 2-30 us on the 2-core VM whatever its size (a 576-wide ``rms_norm`` took
30 us, a one-query attention 110-220 us), and its ~270 parallel regions a token each wake a thread. Here a
layer whose products all run on kvsnap's kernel (``QuantizedLinear.kernel == "a16"``) is two calls in one
parallel region each:

1. ``kv_layer_qkv``: the input norm, the fused q/k/v product, the rotation of q and k, and the new rows'
   k and v written into the cache's buffers (``extend``: the cache keeps owning them);
2. ``kv_layer_rest``: each row's attention over the cache (causal: row m at position length - M + m),
   the output projection and residual, the MLP's norm, the fused gate/up product, ``silu(gate) * up``,
   the down product and residual.

``run_layers`` makes one call of every layer (``kv_layers``) where no hook watches the layers; ``run``
is one layer, for a layer called as a module. Both run the same C per row, and every row's arithmetic
is the same whatever the call holds: a token's KV and logits are the same bits in a decode step, in
any chunk or in a whole prompt (tests/test_qkernel.py). Only float32 activations of one sequence, over
a float16 cache without a window, come here; anything else runs torch's forward over the same quantized weights.
"""

from __future__ import annotations

import ctypes
import operator
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


class Layer(ctypes.Structure):
    """``kv_layer``: what a layer's forward passes that does not change from call to call."""

    _fields_ = [
        *[(name, Matrix) for name in ("qkv", "o", "gate_up", "down")],
        ("norm_in", ctypes.c_void_p),
        ("norm_post", ctypes.c_void_p),
        *[(name, ctypes.c_float) for name in ("eps_in", "eps_post", "scale")],
        *[(name, ctypes.c_int64) for name in ("hidden", "inter", "heads", "kv_heads", "head_dim")],
    ]


class Call(ctypes.Structure):
    """``kv_call``: one call's rows, cache and scratch, by address."""

    _fields_ = [
        ("x", ctypes.c_void_p),
        ("m", ctypes.c_int64),
        ("cos", ctypes.c_void_p),
        ("sin_signed", ctypes.c_void_p),
        ("qkv", ctypes.c_void_p),
        ("keys", ctypes.c_void_p),
        ("values", ctypes.c_void_p),
        *[(name, ctypes.c_int64) for name in ("head_stride", "pos_stride", "length")],
        *[(name, ctypes.c_void_p) for name in ("h", "attn", "act", "xq", "xd", "xs")],
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


def _places(block: Any) -> list[tuple[dict, str]]:
    """Where each module and tensor of the layer's kernel forward hangs: its dict and its key."""
    attn, mlp = block.self_attn, block.mlp
    places = [(attn.__dict__, "qkv"), (mlp.__dict__, "gate_up")]
    for owner, names in (
        (block, ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")),
        (attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
        (mlp, ("gate_proj", "up_proj", "down_proj")),
    ):
        places += [(owner._modules, n) for n in names]
    places += [(norm._parameters, "weight") for norm in (block.input_layernorm, block.post_attention_layernorm)]
    for linear in (*attn.__dict__["qkv"].parts, attn.o_proj, *mlp.__dict__["gate_up"].parts, mlp.down_proj):
        for table in (linear._buffers, linear._parameters, linear.__dict__):
            places += [
                (table, n) for n in ("qweight", "scales", "mins", "bias") if isinstance(table.get(n), torch.Tensor)
            ]
    return places


def _unchanged(step: LayerStep | ModelStep) -> bool:
    """Every module and tensor ``step`` took is still where it took it from, and no tensor was written since."""
    return (
        all(map(operator.is_, [table.get(name) for table, name in step.places], step.held))
        and [t._version for t in step.tensors] == step.versions
    )


class LayerStep:
    """The addresses and shapes a layer's kernel forward passes to the kernels, taken once from its modules.

    It holds what it points into (the modules' tensors, copies it made), so no address it passes can be
    freed under it; ``fresh`` says whether every module and tensor is still the one it took, unwritten since
    (module attribute access costs ~1.6 us a name on the 2-core VM: the check reads the dicts directly)."""

    def __init__(self, block: Any):
        attn, mlp = block.self_attn, block.mlp
        qkv, gate_up = attn.__dict__["qkv"], mlp.__dict__["gate_up"]
        qkv.refresh()
        gate_up.refresh()
        self.places = _places(block)
        self.held = [table[name] for table, name in self.places]
        # Written in place, a tensor is still the memory the kernel reads; its version says it changed, which
        # matters where a copy was made from it (the norms, biases). Inference tensors keep no version.
        self.tensors = [t for t in self.held if isinstance(t, torch.Tensor) and not t.is_inference()]
        self.versions = [t._version for t in self.tensors]
        self.keep: list[torch.Tensor] = [t for f in (qkv, gate_up) for t in (f.whole[0].qweight, f.whole[0].scales)]
        norms = [
            n.weight.detach().float().contiguous() for n in (block.input_layernorm, block.post_attention_layernorm)
        ]
        self.keep += norms
        head_dim = attn.head_dim
        self.widths = qkv.widths  # q, k, v
        self.layer = Layer(
            _matrix(qkv.whole[0], self.keep), _matrix(attn.o_proj, self.keep),
            _matrix(gate_up.whole[0], self.keep), _matrix(mlp.down_proj, self.keep),
            norms[0].data_ptr(), norms[1].data_ptr(),
            float(block.input_layernorm.eps), float(block.post_attention_layernorm.eps), float(attn.scaling),
            attn.o_proj.out_features, mlp.down_proj.in_features,
            self.widths[0] // head_dim, self.widths[1] // head_dim, head_dim,
        )  # fmt: skip
        self.fused = (qkv, gate_up)
        self.like = torch.empty(1, self.widths[1] // head_dim, 0, head_dim)  # the cache's new rows, for its shape

    def fresh(self) -> bool:
        return _unchanged(self)


def step_for(block: Any, x: torch.Tensor, cache: Any) -> LayerStep | None:
    """The layer's kernel forward, or None where torch's must run it: activations other than float32, more
    than one sequence, no cache, a layer with a window, or a product that is not on kvsnap's kernel."""
    if "qkv" not in block.self_attn.__dict__:  # not quantized on kvsnap's kernel (the float models' way out)
        return None
    if x.dtype != torch.float32 or (x.dim() == 3 and x.shape[0] != 1) or cache is None:
        return None
    layer_cache = cache.layers[block.self_attn.index]
    if getattr(layer_cache, "window", None) is not None or getattr(layer_cache, "dtype", None) != torch.float16:
        return None  # the kernel reads and writes a float16 cache without a window
    step = block.__dict__.get("kernel_step")
    if step is None or not step.fresh():
        step = LayerStep(block) if _kernel_layer(block) else None
        block.__dict__["kernel_step"] = step
    return step


def _kernel_layer(block: Any) -> bool:
    attn, mlp = block.self_attn, block.mlp
    fused = attn.__dict__.get("qkv"), mlp.__dict__.get("gate_up")
    if any(f is None or f.whole[0].kernel != "a16" for f in fused) or attn.head_dim % 8:
        return False  # the attention reads heads 8 floats at a time
    return all(isinstance(m, QuantizedLinear) and m.kernel == "a16" for m in (attn.o_proj, mlp.down_proj)) and all(
        n.weight.dtype == torch.float32 for n in (block.input_layernorm, block.post_attention_layernorm)
    )


def _scratch_for(step: LayerStep, m: int) -> Call:
    """This thread's call, its scratch large enough for ``m`` rows (made anew, twice as large, when not)."""
    layer = step.layer
    widest = max(layer.hidden, layer.inter, step.widths[0])
    size = {
        "qkv": m * sum(step.widths), "h": m * max(layer.hidden, layer.inter), "attn": m * step.widths[0],
        "act": m * 2 * layer.inter, "xq": m * widest, "xd": m * widest // qkernel.GROUP,
        "xs": m * widest // qkernel.GROUP,
    }  # fmt: skip
    held = getattr(_scratch, "held", None)
    if held is None or any(held[name].numel() < n for name, n in size.items()):
        types = {"xq": qkernel.ACTIVATIONS}
        held = {name: torch.empty(2 * n, dtype=types.get(name, torch.float32)) for name, n in size.items()}
        _scratch.held = held
        call = _scratch.call = Call()
        for name in ("qkv", "h", "attn", "act", "xq", "xd", "xs"):
            setattr(call, name, held[name].data_ptr())
    return _scratch.call


def _rows(step: LayerStep, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor):
    d = step.layer.head_dim
    rows = x.reshape(-1, step.layer.hidden).clone()  # updated in place by the kernels
    m = rows.shape[0]
    if cos.numel() != m * d:
        cos, sin_signed = cos.reshape(-1, d).expand(m, d), sin_signed.reshape(-1, d).expand(m, d)
    return rows, cos.contiguous(), sin_signed.contiguous()


def _extend(step: LayerStep, cache_layer: Any, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's cache with room for ``m`` more positions, as [1, kv_heads, length, head_dim] views the
    kernel writes the new rows' k and v into."""
    keys, values = cache_layer.extend(m, step.like)
    if keys.stride(3) != 1 or values.stride() != keys.stride() or keys.dtype != torch.float16:
        raise RuntimeError("a cache buffer the kernel cannot write")  # the buffers are the cache's own: never
    return keys, values


def run(
    step: LayerStep, attn: Any, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, cache: Any
) -> torch.Tensor:
    """The layer over M new rows: x [..., M, hidden] float32 (one sequence); cos and sin_signed [M, head_dim]
    or [head_dim] for every row. Returns the layer's output, shaped as x."""
    lib = qkernel.library()
    rows, cos, sin_signed = _rows(step, x, cos, sin_signed)
    m = rows.shape[0]
    keys, values = _extend(step, cache.layers[attn.index], m)
    call = _scratch_for(step, m)
    call.x, call.m, call.cos, call.sin_signed = rows.data_ptr(), m, cos.data_ptr(), sin_signed.data_ptr()
    call.keys, call.values = keys.data_ptr(), values.data_ptr()
    call.head_stride, call.pos_stride, call.length = keys.stride(1), keys.stride(2), keys.shape[2]
    layer, where = ctypes.byref(step.layer), ctypes.byref(call)
    lib.kv_layer_qkv(layer, where)
    if lib.kv_layer_rest(layer, where) != 0:
        raise _no_memory(m, call.length)
    return rows.view(x.shape)


class ModelStep:
    """Every layer's kernel forward in one call (``kv_layers``): what a step passes for all of them."""

    def __init__(self, steps: list[LayerStep], blocks: list[Any]):
        self.steps, self.blocks = steps, blocks
        self.layers = (Layer * len(steps))(*[s.layer for s in steps])
        self.places = [place for s in steps for place in s.places]
        self.held = [h for s in steps for h in s.held]
        self.tensors = [t for s in steps for t in s.tensors]
        self.versions = [t._version for t in self.tensors]
        self.keys = (ctypes.c_void_p * len(steps))()
        self.values = (ctypes.c_void_p * len(steps))()
        self.strides = (ctypes.c_int64 * (2 * len(steps)))()

    def fresh(self) -> bool:
        return _unchanged(self)


def _hooked(blocks: Any) -> bool:
    """Whether a forward hook would see the layers one by one (it must then: ``decode_step`` promises it)."""
    hooks = torch.nn.modules.module
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
        return True
    return any(b._forward_hooks or b._forward_pre_hooks for b in blocks)


def run_layers(decoder: Any, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, cache: Any):
    """Every layer over the M new rows in one call into the kernels, or None where any layer must run on its
    own (``step_for`` refuses one, or a hook watches the layers). Its result is ``run``'s, layer after layer."""
    blocks = decoder.layers
    whole = decoder.__dict__.get("kernel_steps")
    if whole is None or whole.blocks != list(blocks) or not whole.fresh():
        steps = [step_for(b, x, cache) for b in blocks]
        if any(s is None for s in steps):
            decoder.__dict__.pop("kernel_steps", None)
            return None
        whole = decoder.__dict__["kernel_steps"] = ModelStep(steps, list(blocks))
    if _hooked(blocks) or x.dtype != torch.float32 or (x.dim() == 3 and x.shape[0] != 1):
        return None
    lib = qkernel.library()
    first = whole.steps[0]
    rows, cos, sin_signed = _rows(first, x, cos, sin_signed)
    m = rows.shape[0]
    length = 0
    for i, (step, block) in enumerate(zip(whole.steps, blocks)):
        layer_cache = cache.layers[block.self_attn.index]
        if getattr(layer_cache, "window", None) is not None:
            raise RuntimeError("a layer with a window reached the kernel forward")  # step_for refuses these
        keys, values = _extend(step, layer_cache, m)
        whole.keys[i], whole.values[i] = keys.data_ptr(), values.data_ptr()
        whole.strides[2 * i], whole.strides[2 * i + 1] = keys.stride(1), keys.stride(2)
        length = keys.shape[2]
    call = _scratch_for(max(whole.steps, key=lambda s: s.layer.inter), m)
    call.x, call.m, call.cos, call.sin_signed = rows.data_ptr(), m, cos.data_ptr(), sin_signed.data_ptr()
    call.length = length
    if lib.kv_layers(len(whole.steps), whole.layers, ctypes.byref(call), whole.keys, whole.values, whole.strides):
        raise _no_memory(m, length)
    return rows.view(x.shape)


def _no_memory(m: int, length: int) -> MemoryError:
    return MemoryError(f"no memory for the attention scores of {m} rows over {length} positions")
