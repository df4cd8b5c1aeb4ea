"""What a GGUF's tensors are (``layer_types``, cached), and its own Q4_0 blocks as kvsnap's int4 codes.

Why: a GGUF is converted to float weights, and the quantized model is made from those. Q4_1 and Q8_0 weights
come back as the file's own codes and scales that way (their layouts are kvsnap's kernel's, found again
from the float values), but Q4_0's do not: its blocks are symmetric (``w = d * (q - 8)``), and a group whose
codes do not reach both 0 and 15 rounds to another scale and minimum. Its blocks are kvsnap's int4 layout
as they are (a float16 ``d``, 16 bytes of codes with element ``j`` in the low nibble and ``j + 16`` in the
high one), with the minimum ``-8 d``, which float16 holds exactly: this module reads them from the file.

A block is taken only if its dequantization is, bit for bit, the float weight the conversion wrote for the
module (directly, or with llama.cpp's interleave of each q/k head's rotary halves undone): a tensor that
maps to no module, or to another one, is never used. A model with such codes is another model than the
one quantized from its float weights alone: its quantization is named with ``SUFFIX``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

GROUP = 32
SUFFIX = "+q4_0"  # in the quantization's name: some int4 codes are the file's own Q4_0 blocks
_Q4_0_BYTES = 18  # float16 d, then 16 bytes of codes
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def module_name(tensor_name: str) -> str | None:
    """The module a GGUF tensor of a Llama-family file is the weight of (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj``); None for anything else."""
    parts = tensor_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight":
        inner = LAYER_NAMES.get(parts[2])
        return f"model.layers.{int(parts[1])}.{inner}" if inner is not None else None
    return None


def q4_0_blocks(raw: np.ndarray, rows: int, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(codes, d, mins)`` of a Q4_0 tensor's bytes for a [rows, width] weight: codes uint8 [rows, width / 2],
    d and mins float16 [rows, width / 32] (``mins = -8 d``)."""
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, width // GROUP, _Q4_0_BYTES)
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16).reshape(rows, width // GROUP)
    codes = np.ascontiguousarray(blocks[..., 2:]).reshape(rows, width // 2)
    return codes, d, (d * np.float16(-8)).astype(np.float16)


def _dequantized(codes: np.ndarray, d: np.ndarray, mins: np.ndarray) -> np.ndarray:
    rows, half = codes.shape
    grouped = codes.reshape(rows, -1, GROUP // 2)
    q = np.concatenate([grouped & 0x0F, grouped >> 4], axis=2).reshape(rows, half * 2).astype(np.float32)
    return q * np.repeat(d.astype(np.float32), GROUP, axis=1) + np.repeat(mins.astype(np.float32), GROUP, axis=1)


def _interleaved_rows(rows: int, heads: int) -> np.ndarray:
    """The row order llama.cpp's converter writes a q/k weight of ``heads`` heads in, as indices of the
    checkpoint's rows: each head's two rotary halves interleaved."""
    per = rows // heads // 2
    return np.arange(rows).reshape(heads, 2, per).swapaxes(1, 2).reshape(rows)


def layer_types(gguf: Path) -> dict[str, str] | None:
    """``{tensor name: GGML type name}`` of the GGUF's 2-D layer weights (``blk.*``); None: not readable.

    Why cached: gguf-py's reader parses every metadata value in Python (a 49,152-entry vocabulary: about 2 s
    on the 2-core VM) to list the tensors, and ``--quantize auto`` asks in every new process. The answer is
    kept under ``$KVSNAP_HOME/digests`` keyed by the file's identity and times (``fingerprint.file_stamp``:
    any write changes them), and read back bounded, as input: one that does not parse is asked again."""
    from kvsnap.models.catalog import kvsnap_home
    from kvsnap.models.fingerprint import file_stamp
    from kvsnap.paths import json_object

    try:
        stamp = file_stamp(os.stat(gguf))
        key = hashlib.blake2b(str(gguf.resolve()).encode(), digest_size=8).hexdigest()
    except OSError:
        return None
    cache = kvsnap_home() / "digests" / f"gguf-{key}.json"
    kept = json_object(cache)
    types = kept.get("types") if kept is not None and kept.get("stamp") == stamp else None
    if isinstance(types, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in types.items()):
        return types
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(gguf))
        types = {t.name: t.tensor_type.name for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2}
    except Exception:
        return None
    with contextlib.suppress(OSError):  # a read-only home only costs the parse next time
        from kvsnap.format.atomic import replace_whole

        cache.parent.mkdir(parents=True, exist_ok=True)
        replace_whole(cache, [json.dumps({"stamp": stamp, "types": types}).encode()], 0o600)
    return types


def has_q4_0(gguf: Path) -> bool:
    """Whether the GGUF holds a Q4_0 layer weight of a module (``layer_types``: its blocks are not read)."""
    types = layer_types(gguf) or {}
    return any(kind == "Q4_0" and module_name(name) is not None for name, kind in types.items())


def own_int4_codes(gguf: Path, weights: dict[str, torch.Tensor], heads: dict[str, int]) -> dict[str, dict]:
    """``{module name: {"qweight", "scales", "mins"}}`` from the file's Q4_0 blocks, for the modules whose
    float ``weights`` (name -> [N, K] float32) those blocks are, bit for bit. ``heads``: module name -> the
    head count of a q/k projection (its rows may be interleaved in the file)."""
    from gguf import GGMLQuantizationType, GGUFReader

    found: dict[str, dict[str, Any]] = {}
    try:
        reader = GGUFReader(str(gguf))
    except Exception:
        return found  # the conversion read the file; a file changed since is not read again here
    for tensor in reader.tensors:
        name = module_name(tensor.name)
        weight = weights.get(name) if name is not None else None
        if weight is None or tensor.tensor_type != GGMLQuantizationType.Q4_0 or weight.dtype != torch.float32:
            continue
        rows, width = weight.shape
        if width % GROUP or tensor.data.size != rows * width // GROUP * _Q4_0_BYTES:
            continue
        codes, d, mins = q4_0_blocks(tensor.data, rows, width)
        want = weight.numpy()
        orders = [None]
        if name in heads and rows % (2 * heads[name]) == 0:
            orders.append(np.argsort(_interleaved_rows(rows, heads[name])))
        for order in orders:
            c, dd, mm = (codes, d, mins) if order is None else (codes[order], d[order], mins[order])
            if np.array_equal(_dequantized(c, dd, mm), want):
                found[name] = {
                    "qweight": torch.from_numpy(np.ascontiguousarray(c)),
                    "scales": torch.from_numpy(np.ascontiguousarray(dd)),
                    "mins": torch.from_numpy(np.ascontiguousarray(mm)),
                }
                break
    return found
