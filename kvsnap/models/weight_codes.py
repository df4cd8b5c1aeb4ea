"""Float weights to integer codes and scales, one layout each, a few thousand rows at a time.

The rounding of each layout is written once here: ``kvsnap.models.quantize`` builds its linears from these,
``kvsnap.models.qkernel`` computes ``int4_pairs`` in C bit for bit. Where a layout is a GGUF type's (Q8_0,
Q4_1), the codes found from that type's dequantized weights are the file's own.
"""

from __future__ import annotations

import torch

from kvsnap.models import qkernel

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


def int8_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, d)``: ``weight ~= q * d`` per group of 32 inputs, ``q`` int8 [N, K] in -127..127, ``d`` float16
    [N, K / 32] (GGUF's Q8_0, kvsnap's kernel's int8 layout). From a Q8_0 file's dequantized weights this finds
    the file's own codes and scales: each group's largest code is 127, so ``max |w| / 127`` is its scale."""
    n, k = weight.shape
    q = torch.empty(n, k, dtype=torch.int8)
    d = torch.empty(n, k // qkernel.GROUP, dtype=torch.float16)
    for start in range(0, n, ROWS_AT_ONCE):
        grouped = weight[start : start + ROWS_AT_ONCE].detach().float().reshape(-1, k // qkernel.GROUP, qkernel.GROUP)
        scale = (grouped.abs().amax(dim=2) / 127).half().clamp(min=torch.finfo(torch.float16).tiny)
        codes = grouped / scale.float()[..., None]
        q[start : start + ROWS_AT_ONCE] = codes.round_().clamp_(-127, 127).reshape(-1, k)
        d[start : start + ROWS_AT_ONCE] = scale
    return q, d


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
