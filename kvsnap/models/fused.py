"""One quantized product for several linears that read the same input: q/k/v, and gate/up.

Why: a decode step of a quantized model is a chain of small products, each a cast in, a kernel call and a
cast out. Three projections of one normed row as one kernel call over their codes laid end to end cost a
third of the calls, and each output column is the same dot product in the same order, so the fused
product equals the separate ones bit for bit (tests/test_qkernel.py).

The parts keep their codes as views into the fused tensors, so fusing adds no memory for them; torch's
int4 layout keeps its scales as ``[K / group, N, 2]``, which cannot be viewed per part, so there the fused
module holds its own copy of the scales (1/16 of the codes' size). A part changed in place or replaced
since makes the fused module lay itself out anew from the parts before its next product: the parts are
what the general forward runs.
"""

from __future__ import annotations

import torch
from torch import nn

from kvsnap.models import quantize
from kvsnap.models.quantize import QuantizedLinear


class FusedQuantized(nn.Module):
    """The product of ``parts`` (quantized linears of one input width, bits, group and kernel) as one."""

    def __init__(self, parts: list[QuantizedLinear]):
        super().__init__()
        if not fusable(parts):
            raise ValueError("these linears cannot run as one product (fusable)")
        self.parts = parts  # a plain list: the parts stay where they are in the module tree
        self.widths = [p.out_features for p in parts]
        self._build()

    @classmethod
    def over(cls, parts: list[QuantizedLinear], whole: QuantizedLinear) -> FusedQuantized:
        """The fused product of ``parts`` whose tensors are already rows of ``whole``'s, end to end (as a file
        of codes keeps them): nothing is copied."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.parts, self.widths = parts, [p.out_features for p in parts]
        self.whole = [whole]
        self._seen = self._state()
        return self

    def _build(self) -> None:
        parts, first = self.parts, self.parts[0]
        # The product itself is a QuantizedLinear's: one that holds the parts' tensors end to end.
        whole = QuantizedLinear.__new__(QuantizedLinear)
        nn.Module.__init__(whole)
        whole.in_features, whole.out_features = first.in_features, sum(self.widths)
        whole.bits, whole.group, whole.kernel, whole.q4 = first.bits, first.group, first.kernel, None
        names = ["qweight", "scales", "mins"] if first.mins is not None else ["qweight", "scales"]
        for name in names:
            torch_int4_scales = name == "scales" and first.kernel == "bf16" and first.bits == 4
            joined = torch.cat([getattr(p, name) for p in parts], dim=1 if torch_int4_scales else 0)
            setattr(whole, name, joined)
            if not torch_int4_scales:
                start = 0
                for part, width in zip(parts, self.widths):
                    setattr(part, name, joined[start : start + width])  # one copy, shared with the parts
                    start += width
        if first.mins is None:
            whole.mins = None
        whole.bias = None
        if any(p.bias is not None for p in parts):
            whole.bias = torch.cat(
                [p.bias if p.bias is not None else torch.zeros(w) for p, w in zip(parts, self.widths)]
            )
        self.whole = [whole]  # in a list: not a submodule, so not a second name in the state dict
        self._seen = self._state()

    def _state(self) -> list[tuple[int, int]]:
        # Identity and in-place version: a part's tensor replaced (moved, cast) or written (loaded) since.
        # An inference tensor keeps no version (written in place, it is still the memory the product reads).
        return [
            (id(t), 0 if t.is_inference() else t._version)
            for p in self.parts
            for t in (p.qweight, p.scales, p.mins, p.bias)
            if t is not None
        ]

    def refresh(self) -> None:
        """Lay the codes out anew if a part changed since."""
        if self._state() != self._seen:
            self._build()

    def forward(self, row: torch.Tensor) -> torch.Tensor:
        """``row``: ``[1, K]``; returns ``[1, sum(widths)]`` in its dtype."""
        self.refresh()
        return self.whole[0](row)


def fusable(parts: list[object]) -> bool:
    """Whether ``parts`` can run as one ``FusedQuantized``: CPU quantized linears of one width and layout,
    whose codes laid end to end are the fused product's (torch's int4 layout: only where each part ends
    on a block of its packing; elsewhere the parts run one by one)."""
    if not parts or not all(isinstance(p, QuantizedLinear) for p in parts):
        return False
    first = parts[0]
    torch_int4 = first.kernel == "bf16" and first.bits == 4
    if torch_int4 and not quantize.packs_concatenate(tuple(p.out_features for p in parts)):
        return False
    return all(
        p.bits == first.bits
        and p.group == first.group
        and p.kernel == first.kernel
        and p.in_features == first.in_features
        and p.qweight.device.type == "cpu"
        and p.qweight.is_contiguous()
        for p in parts
    )


def fuse(model: nn.Module) -> int:
    """Give each native attention a ``qkv`` and each MLP a ``gate_up`` fused product where its parts allow
    (``kvsnap.models.decode_step`` runs them). Returns how many were made."""
    made = 0
    for module in list(model.modules()):
        names = None
        if all(hasattr(module, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            names, attr = ("q_proj", "k_proj", "v_proj"), "qkv"
        elif all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj")):
            names, attr = ("gate_proj", "up_proj"), "gate_up"
        if names is None:
            continue
        parts = [getattr(module, n) for n in names]
        if fusable(parts):
            # Set through __dict__: as a submodule it would be a second name for the parts' codes in the
            # state dict, which must stay the model's own.
            module.__dict__[attr] = FusedQuantized(parts)
            made += 1
    return made
