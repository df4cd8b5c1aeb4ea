"""Shared helpers for the core-layer tests (hashing, prefix, codec, snapshot): no model, no torch.

Builds small synthetic KV caches in the ``[layers, 2, kv_heads, tokens, head_dim]`` layout, writes
them as ``.kv`` snapshots, reads them back, and edits the safetensors header of a written file.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvsnap import hashing
from kvsnap.format import Snapshot, SnapshotHeader, encode_block, write_snapshot
from kvsnap.hashing import checksum
from kvsnap.types import EncodedBlock, KVLayout

MODEL = "test/tiny-model"
FINGERPRINT = "fp-0123456789abcdef"
NAMESPACE = "default"

# Numpy dtype holding each KV dtype's bit patterns (bfloat16 travels as uint16: bit-exact, no maths).
NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def make_layout(dtype: str = "float32", layers: int = 2, kv_heads: int = 2, head_dim: int = 4) -> KVLayout:
    return KVLayout(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)


def make_kv(layout: KVLayout, num_tokens: int, seed: int = 0) -> np.ndarray:
    """KV-like values: gaussian with a realistic scale; bfloat16 as its uint16 bit patterns."""
    rng = np.random.default_rng(seed)
    # kv: [layers, 2, kv_heads, tokens, head_dim]
    shape = (layout.num_layers, 2, layout.num_kv_heads, num_tokens, layout.head_dim)
    values = (rng.standard_normal(shape) * 0.5).astype(np.float32)
    if layout.dtype == "bfloat16":
        # Round-to-nearest-even float32 -> bfloat16, kept as raw bits.
        bits = values.view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.astype(np.uint16)
    return values.astype(NP_DTYPES[layout.dtype])


def block_raws(kv: np.ndarray, block_size: int) -> list[bytes]:
    """The raw bytes of each block: the token axis cut into ``block_size`` pieces, last one short."""
    num_tokens = kv.shape[3]
    return [
        np.ascontiguousarray(kv[:, :, :, s : s + block_size, :]).tobytes() for s in range(0, num_tokens, block_size)
    ]


@dataclass
class Written:
    """What a test snapshot was written from, to compare a read against."""

    path: Path
    tokens: list[int]
    raws: list[bytes]
    layout: KVLayout
    root: bytes
    blocks: list[EncodedBlock]
    size: int


def write_test_snapshot(
    path: Path,
    *,
    num_tokens: int = 10,
    block_size: int = 4,
    layout: KVLayout | None = None,
    codec: str = "shuffle-zstd",
    level: int = 1,
    last_logits: np.ndarray | None = None,
    messages: list[dict[str, str]] | None = None,
    extra: dict[str, Any] | None = None,
    fingerprint: str = FINGERPRINT,
    namespace: str = NAMESPACE,
    seed: int = 0,
    key: Any = None,
) -> Written:
    layout = layout or make_layout()
    tokens = [int(t) for t in np.random.default_rng(seed + 1).integers(0, 50_000, num_tokens)]
    root = hashing.chain_root(fingerprint, namespace, block_size)
    hashes = hashing.chain_hashes(tokens, block_size, root)
    raws = block_raws(make_kv(layout, len(tokens), seed), block_size)
    blocks = []
    for i, raw in enumerate(raws):
        n = min(block_size, len(tokens) - i * block_size)
        h = hashes[i] if i < len(hashes) else None
        blocks.append(encode_block(raw, n, h, layout.itemsize, codec, level))
    size = write_snapshot(
        path,
        SnapshotHeader(
            model=MODEL,
            fingerprint=fingerprint,
            root=root,
            layout=layout,
            block_size=block_size,
            codec=codec,
            level=level,
            extra=extra,
        ),
        tokens,
        blocks,
        last_logits=last_logits,
        messages=messages,
        key=key,
    )
    return Written(path, tokens, raws, layout, root, blocks, size)


def read_everything(path: Path) -> dict[str, Any]:
    """Open a snapshot and read all it holds: meta, tokens, every block decoded, last logits."""
    with Snapshot(path) as snap:
        blocks = snap.read_raw(range(len(snap.meta.blocks)))
        logits = snap.last_logits()
        return {
            "meta": snap.meta,
            "tokens": list(snap.tokens),
            "blocks": [bytes(b) for b in blocks],
            "logits": None if logits is None else logits.tobytes(),
        }


def assert_one_line(exc: BaseException) -> None:
    message = str(exc)
    assert message, f"{type(exc).__name__} with an empty message"
    assert "\n" not in message and "\r" not in message, f"multi-line message: {message!r}"


# ---------------------------------------------------------------------------------------------
# The safetensors container, by hand: 8-byte little-endian header length, JSON header, data.


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The safetensors header of ``path`` and the absolute offset where its data starts."""
    data = path.read_bytes()
    (header_len,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8 : 8 + header_len])
    return header, 8 + header_len


def tensor_span(path: Path, name: str) -> tuple[int, int]:
    """Absolute ``[start, end)`` byte offsets of tensor ``name``'s data in the file."""
    header, data_start = read_header(path)
    start, end = header[name]["data_offsets"]
    return data_start + start, data_start + end


def rewrite_meta_text(path: Path, text: str, *, fix_checksum: bool = True) -> None:
    """Replace the kvsnap metadata JSON of a written file (re-signing it unless told not to)."""
    header, data_start = read_header(path)
    body = path.read_bytes()[data_start:]
    header["__metadata__"]["kvsnap"] = text
    if fix_checksum:
        header["__metadata__"]["kvsnap_checksum"] = checksum(text.encode())
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    path.write_bytes(struct.pack("<Q", len(header_bytes)) + header_bytes + body)


def rewrite_meta(path: Path, mutate: Callable[[dict[str, Any]], None]) -> None:
    """Edit the kvsnap metadata dict of a written file in place, keeping its checksum valid."""
    header, _ = read_header(path)
    meta = json.loads(header["__metadata__"]["kvsnap"])
    mutate(meta)
    rewrite_meta_text(path, json.dumps(meta, separators=(",", ":"), ensure_ascii=False))


def kvsnap_imports(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None):
    """Run ``kvsnap ARGS`` as a user starts it, under ``-X importtime``: (the process, the modules it imported).

    The CLI's ``main`` ends its process itself (``kvsnap_cli.startup.leave``), so what a process imported is
    read from its ``-X importtime`` lines, not from ``sys.modules`` after ``main`` returns."""
    import subprocess
    import sys

    cmd = [sys.executable, "-X", "importtime", "-m", "kvsnap_cli.main", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env)
    lines = proc.stderr.splitlines()
    imported = {line.rsplit("|", 1)[-1].strip() for line in lines if line.startswith("import time:")}
    assert "kvsnap_cli.run" in imported, proc.stderr[-2000:]  # the list was read: "torch" not in it means something
    proc.stderr = "\n".join(line for line in lines if not line.startswith("import time:"))
    return proc, imported
