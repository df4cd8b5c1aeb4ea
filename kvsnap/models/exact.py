"""A batch-invariant forward for the native model: the KV of a token does not depend on how the prompt
was cut into forwards (one forward, chunks of 32, one token at a time, chunks of any other size).

Why: a BLAS or oneDNN matrix product picks its kernel, and with it the order in which each output's sum
is taken, by the shape of the call; torch's CPU attention cuts queries and keys into blocks whose size
depends on the number of queries and keys. So the same token's K and V come out of a 500-token forward
and of a 12-token one apart by a rounding: in float32 a few ulps that greedy decoding shrugs off; in
bfloat16 whole ulps of an 8-bit mantissa, enough to change the answer of a resumed run against a cold
one. Here every reduction a token's values go through is taken in an order fixed by that token alone:

- linear layers: the rows go through the product ``EXACT_ROWS`` at a time, every call of that one
  shape (padded with zero rows below it): over one shape, a row's result depends on that row alone;
- attention, in float32: keys in blocks of ``EXACT_KEYS`` from key 0, queries in tiles of
  ``EXACT_QUERIES`` positions (each with its group's heads), every product one shape
  (``[EXACT_KEYS, head_dim] @ [head_dim, rows]``, then ``[rows, EXACT_KEYS] @ [EXACT_KEYS, head_dim + 1]``,
  the extra column of ones summing the softmax's weights); a row's maximum is exact in any order,
  and the blocks' partial sums are added in block order (``cumsum``, accumulated in float64); masked
  or padded keys add exact zeros;
- elementwise functions run on vectors whose lanes all compute alike (``torch.exp`` on every element;
  ``F.silu`` computes the tail of a tensor by another formula, so it is spelled out); norms reduce one
  row in float32 whatever the row count.

What holds is one machine's, torch build's and thread count's: another CPU or library rounds its own
way, as for any forward. tests/test_exact_dtype.py checks it on every CPU the suite runs on: bitwise
equal KV for the cuts above, in float32 and bfloat16, and resumed == cold. What it costs (more calls,
each smaller, and a decode step computing ``EXACT_ROWS`` rows): ``benchmarks/exact.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

EXACT_ROWS = 16  # rows per linear product: a decode step pays for this many
EXACT_QUERIES = 8  # query positions per attention product (times the heads sharing a KV head)
EXACT_KEYS = 128  # keys per attention block
SCORES_BYTES = 64 << 20  # the most attention scores held at once (tiles are done in groups)


def in_row_tiles(x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``product(x)`` over the last dimension, computed ``EXACT_ROWS`` rows per call: a short last tile
    is the last ``EXACT_ROWS`` rows (some computed twice, alike), fewer rows are padded with zeros."""
    rows = x.reshape(-1, x.shape[-1])
    n, tile = rows.shape[0], EXACT_ROWS
    if n <= tile:
        padded = rows if n == tile else torch.cat([rows, rows.new_zeros(tile - n, rows.shape[1])])
        out = product(padded)[:n]
    else:
        first = product(rows[:tile])
        out = first.new_empty(n, first.shape[1])
        out[:tile] = first
        for start in range(tile, n - tile + 1, tile):
            out[start : start + tile] = product(rows[start : start + tile])
        if n % tile:
            out[n - tile :] = product(rows[n - tile :])
    return out.view(*x.shape[:-1], out.shape[-1])


def one_row_at_a_time(x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``product(x)`` one row per call: for the lm_head, which a forward runs on its last row alone."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 1:
        return product(x)
    out = torch.cat([product(rows[i : i + 1]) for i in range(rows.shape[0])])
    return out.view(*x.shape[:-1], out.shape[-1])


def silu(x: torch.Tensor) -> torch.Tensor:
    """``F.silu``, in float32 then rounded once, by one formula on every element."""
    x32 = x.float()
    return (x32 / (1 + torch.exp(-x32))).to(x.dtype)


@dataclass(frozen=True)
class Plan:
    """How one forward's attention is cut, the same for every layer: the queries at positions ``past ..
    past + count - 1`` in ``tiles`` tiles of ``EXACT_QUERIES`` positions, the keys ``0 .. past + count - 1``
    in ``blocks`` blocks of ``EXACT_KEYS``; ``hidden`` [tiles, 1, blocks, EXACT_KEYS, rows]: the key is
    after the row's position (or past the last key)."""

    past: int
    count: int
    groups: int  # query heads per KV head; a tile's rows: head 0 of the group at each position, head 1, ...
    tiles: int
    blocks: int
    hidden: torch.Tensor

    @classmethod
    def of(cls, past: int, count: int, groups: int, device: torch.device) -> Plan:
        tiles, blocks = math.ceil(count / EXACT_QUERIES), math.ceil((past + count) / EXACT_KEYS)
        position = past + torch.arange(tiles * EXACT_QUERIES, device=device).view(tiles, 1, EXACT_QUERIES)
        key = torch.arange(blocks * EXACT_KEYS, device=device).view(1, blocks * EXACT_KEYS, 1)
        hidden = (key > position).repeat(1, 1, groups)  # [tiles, keys, rows]
        return cls(past, count, groups, tiles, blocks, hidden.view(tiles, 1, blocks, EXACT_KEYS, -1))


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, plan: Plan, by_tile: bool | None = None
) -> torch.Tensor:
    """Causal attention of ``q`` [1, heads, count, dim] over ``k``, ``v`` [1, kv heads, past + count, dim]:
    [1, count, heads * dim] in ``q``'s dtype, each row as if computed alone.

    Every (query tile, key block) pair is one product of one shape; they are batched along the tiles
    (one call per KV head and key block) or along the blocks (one per tile), whichever makes fewer calls:
    a batched product computes each of its items as it would alone (``by_tile`` forces one way). Tiles
    go in groups whose scores fit in ``SCORES_BYTES``."""
    _, heads, count, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    groups, tiles, blocks, width = plan.groups, plan.tiles, plan.blocks, EXACT_QUERIES
    rows, size = groups * width, EXACT_KEYS
    # Keys and values in float32, zero past the last key; the values with a column of ones: the
    # softmax's denominator comes out of the same product as its numerator.
    k32 = k.new_zeros((kv_heads, blocks * size, dim), dtype=torch.float32)
    k32[:, :keys] = k[0]
    v32 = k.new_zeros((kv_heads, blocks * size, dim + 1), dtype=torch.float32)
    v32[:, :keys, :dim] = v[0]
    v32[:, :, dim] = 1
    k32, v32 = k32.view(kv_heads, blocks, size, dim), v32.view(kv_heads, blocks, size, dim + 1)
    # Queries: [tile, kv head, rows, dim], zero past the last position.
    q32 = q.new_zeros((kv_heads, groups, tiles * width, dim), dtype=torch.float32)
    q32[:, :, :count] = q[0].view(kv_heads, groups, count, dim)
    q32 = q32.view(kv_heads, groups, tiles, width, dim).permute(2, 0, 1, 3, 4).reshape(tiles, kv_heads, rows, dim)
    out = q32.new_empty((tiles, kv_heads, rows, dim))
    step = max(1, SCORES_BYTES // (4 * kv_heads * blocks * size * rows))
    for first in range(0, tiles, step):
        last = min(tiles, first + step)
        one_way = by_tile if by_tile is not None else last - first <= kv_heads * blocks
        _attend(q32[first:last], k32, v32, plan.hidden[first:last], scale, one_way, out[first:last])
    # Back to [1, count, heads * dim], heads in kv head * group order (torch's enable_gqa mapping).
    out = out.view(tiles, kv_heads, groups, width, dim).permute(0, 3, 1, 2, 4).reshape(tiles * width, heads * dim)
    return out[:count].to(q.dtype).unsqueeze(0)


def _attend(q32, k32, v32, hidden, scale: float, by_tile: bool, out: torch.Tensor) -> None:
    """``out`` [tiles, kv heads, rows, dim] = the attention of the tiles ``q32`` [tiles, kv heads, rows, dim]
    over every key block of ``k32``, ``v32`` [kv heads, blocks, size, dim (+ 1)]."""
    tiles, kv_heads, rows, dim = q32.shape
    blocks, size = k32.shape[1], k32.shape[2]
    scores = q32.new_empty((tiles, kv_heads, blocks, size, rows))
    parts = q32.new_empty((tiles, kv_heads, blocks, rows, dim + 1))
    if by_tile:
        for t in range(tiles):
            # [dim, rows] items as transposed views, as below: the same product, item for item.
            queries = q32[t, :, None].expand(kv_heads, blocks, rows, dim).reshape(-1, rows, dim).transpose(1, 2)
            torch.bmm(k32.view(-1, size, dim), queries, out=scores[t].view(-1, size, rows))
    else:
        for h in range(kv_heads):
            for b in range(blocks):
                torch.bmm(k32[h, b].expand(tiles, size, dim), q32[:, h].transpose(1, 2), out=scores[:, h, b])
    scores.mul_(scale).masked_fill_(hidden, float("-inf"))
    top = scores.amax(dim=(2, 3), keepdim=True)  # a maximum is exact in any order
    weights = scores.sub_(top).exp_()
    if by_tile:
        for t in range(tiles):
            items = weights[t].view(-1, size, rows).transpose(1, 2)
            torch.bmm(items, v32.view(-1, size, dim + 1), out=parts[t].view(-1, rows, dim + 1))
    else:
        for h in range(kv_heads):
            for b in range(blocks):
                value = v32[h, b].expand(tiles, size, dim + 1)
                torch.bmm(weights[:, h, b].transpose(1, 2), value, out=parts[:, h, b])
    total = parts.cumsum(dim=2)[:, :, -1]  # block after block, summed in float64
    torch.div(total[..., :dim], total[..., dim:], out=out)
