"""Generator of the golden ``.kv`` files: format version 1 files every future kvsnap must still read.

    python tests/data/make_golden.py            # check the committed files (writes nothing)
    python tests/data/make_golden.py --write    # (re)write golden-v1*.kv and golden-v1.json

What it writes, into this folder:

- ``golden-v1.kv``: float32 KV of a 2 layers x 2 kv heads x head dim 4 cache, 20 tokens in blocks of 8
  (two full blocks and a partial tail of 4), codec ``shuffle-zstd`` level 1, 16 last-position
  logits (with -inf, -0.0 and a subnormal among them), chat messages (non-ASCII, emoji, newline,
  quotes), an ``extra`` object.
- ``golden-v1-bf16.kv``: the same cache shape in bfloat16, 19 tokens (8, 8, 3), codec ``zstd``
  level 3, no logits and no messages.
- ``golden-v1.json``: what each file must decode to: tokens, messages, layout, codec, per-block
  token counts, chained hashes and the sha256 of each block's raw (decoded) bytes, the logits,
  ``created_at``, and the sha256 of the file itself. It is computed from the generator's own
  inputs, never by reading the files back, so it checks the reader independently.

Everything is deterministic: the KV values and tokens come from seeded numpy generators, and
``created_at`` (the one value ``write_snapshot`` takes from the clock) is pinned by patching
``time.time`` while writing. tests/test_golden.py rebuilds the files in memory with ``build()`` and
compares them with the committed bytes.

Do NOT regenerate these files casually. They are the compatibility contract of format version
1: a reader change that breaks them breaks every user's saved sessions. If the writer's output
changes on purpose, keep these files as they are (the reader must still accept them) and add
new golden files beside them (``golden-v2*.kv`` with a new generator entry) when the format
version is bumped. ``--write`` is for creating missing files, not for "fixing" a failing test.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

HERE = Path(__file__).resolve().parent
_ROOT = HERE.parents[1]
if str(_ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(_ROOT))

from kvsnap import hashing  # noqa: E402
from kvsnap.format import SnapshotHeader, encode_block, write_snapshot  # noqa: E402
from kvsnap.types import KVLayout  # noqa: E402

JSON_NAME = "golden-v1.json"
CREATED_AT = 1_700_000_000.25  # 2023-11-14T22:13:20.25Z, exactly representable
MODEL = "kvsnap/golden-tiny"
FINGERPRINT = "golden-fingerprint-v1-0123456789abcdef"
NAMESPACE = "default"
MESSAGES = [
    {"role": "system", "content": "You are a golden test. Answer tersely."},
    {"role": "user", "content": 'Héllo — ünïcode 🦙\nsecond line, "quotes", \\ backslash and \t tab'},
    {"role": "assistant", "content": "Bonjour."},
]


@dataclass(frozen=True)
class Variant:
    file: str
    dtype: str
    codec: str
    level: int
    num_tokens: int
    block_size: int
    seed: int
    logits: bool
    messages: bool
    layers: int = 2
    kv_heads: int = 2
    head_dim: int = 4


VARIANTS = {
    v.file: v
    for v in (
        Variant("golden-v1.kv", "float32", "shuffle-zstd", 1, 20, 8, seed=1, logits=True, messages=True),
        Variant("golden-v1-bf16.kv", "bfloat16", "zstd", 3, 19, 8, seed=2, logits=False, messages=False),
    )
}


def _layout(v: Variant) -> KVLayout:
    return KVLayout(num_layers=v.layers, num_kv_heads=v.kv_heads, head_dim=v.head_dim, dtype=v.dtype)


def _tokens(v: Variant) -> list[int]:
    return [int(t) for t in np.random.default_rng(1000 + v.seed).integers(0, 49_152, v.num_tokens)]


def _kv(v: Variant) -> np.ndarray:
    """``[layers, 2, kv_heads, tokens, head_dim]`` values; bfloat16 as its uint16 bit patterns."""
    rng = np.random.default_rng(v.seed)
    values = (rng.standard_normal((v.layers, 2, v.kv_heads, v.num_tokens, v.head_dim)) * 0.5).astype("<f4")
    if v.dtype == "float32":
        return values
    assert v.dtype == "bfloat16"
    bits = values.view("<u4").astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
    return bits.astype("<u2")


def _raws(v: Variant) -> list[bytes]:
    kv = _kv(v)
    return [
        np.ascontiguousarray(kv[:, :, :, s : s + v.block_size, :]).tobytes()
        for s in range(0, v.num_tokens, v.block_size)
    ]


def _logits(v: Variant) -> np.ndarray | None:
    if not v.logits:
        return None
    logits = (np.random.default_rng(2000 + v.seed).standard_normal(16) * 8).astype("<f4")
    logits[:3] = [-np.inf, np.float32(-0.0), np.float32(1e-45)]
    return logits


@contextmanager
def _fixed_clock(value: float):
    """``write_snapshot`` stores ``time.time()`` as created_at: pin it so the bytes are reproducible."""
    with mock.patch.object(time, "time", return_value=value):
        yield


def build(name: str) -> bytes:
    """The bytes of golden file ``name`` as the current writer produces them (nothing is written here)."""
    v = VARIANTS[name]
    layout = _layout(v)
    tokens = _tokens(v)
    root = hashing.chain_root(FINGERPRINT, NAMESPACE, v.block_size)
    hashes = hashing.chain_hashes(tokens, v.block_size, root)
    blocks = []
    for i, raw in enumerate(_raws(v)):
        n = min(v.block_size, v.num_tokens - i * v.block_size)
        blocks.append(encode_block(raw, n, hashes[i] if i < len(hashes) else None, layout.itemsize, v.codec, v.level))
    # write_snapshot writes atomically next to its target (temp file, lock file): let it do so in a
    # scratch folder and hand back the bytes.
    with tempfile.TemporaryDirectory() as tmp, _fixed_clock(CREATED_AT):
        path = Path(tmp) / name
        write_snapshot(
            path,
            SnapshotHeader(
                model=MODEL,
                fingerprint=FINGERPRINT,
                root=root,
                layout=layout,
                block_size=v.block_size,
                codec=v.codec,
                level=v.level,
                extra={"golden": True, "generator": "tests/data/make_golden.py"} if v.messages else None,
            ),
            tokens,
            blocks,
            last_logits=_logits(v),
            messages=MESSAGES if v.messages else None,
        )
        return path.read_bytes()


def expected(name: str, data: bytes) -> dict[str, Any]:
    """What golden file ``name`` must decode to, from the generator's inputs (``data`` only for its hash)."""
    v = VARIANTS[name]
    layout = _layout(v)
    tokens = _tokens(v)
    root = hashing.chain_root(FINGERPRINT, NAMESPACE, v.block_size)
    hashes = hashing.chain_hashes(tokens, v.block_size, root)
    raws = _raws(v)
    logits = _logits(v)
    return {
        "file_sha256": hashlib.sha256(data).hexdigest(),
        "file_bytes": len(data),
        "format_version": 1,
        "model": MODEL,
        "fingerprint": FINGERPRINT,
        "namespace": NAMESPACE,
        "root": root.hex(),
        "layout": {"layers": v.layers, "kv_heads": v.kv_heads, "head_dim": v.head_dim, "dtype": v.dtype},
        "bytes_per_token": layout.bytes_per_token,
        "block_size": v.block_size,
        "codec": v.codec,
        "level": v.level,
        "created_at": CREATED_AT,
        "num_tokens": v.num_tokens,
        "tokens": tokens,
        "blocks": [
            {
                "tokens": min(v.block_size, v.num_tokens - i * v.block_size),
                "hash": hashes[i].hex() if i < len(hashes) else None,
                "raw_bytes": len(raw),
                "raw_sha256": hashlib.sha256(raw).hexdigest(),
            }
            for i, raw in enumerate(raws)
        ],
        "messages": MESSAGES if v.messages else None,
        "extra": {"golden": True, "generator": "tests/data/make_golden.py"} if v.messages else {},
        # float32 values round-trip exactly through Python floats; -inf as a string (not JSON).
        "last_logits": None if logits is None else [repr(float(x)) for x in logits],
        "last_logits_sha256": None if logits is None else hashlib.sha256(logits.tobytes()).hexdigest(),
    }


def golden_json() -> dict[str, Any]:
    import zstandard

    return {
        "about": "Golden kvsnap format-1 files and what they decode to; see make_golden.py. Do not regenerate.",
        "zstd_version": zstandard.ZSTD_VERSION,
        "files": {name: expected(name, build(name)) for name in VARIANTS},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="write the golden files (read the warning first)")
    args = parser.parse_args(argv)
    if args.write:
        for name in VARIANTS:
            (HERE / name).write_bytes(build(name))
        (HERE / JSON_NAME).write_text(json.dumps(golden_json(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        for name in [*VARIANTS, JSON_NAME]:
            print(f"wrote {HERE / name} ({(HERE / name).stat().st_size} bytes)")
        return 0
    stale = [name for name in VARIANTS if not (HERE / name).exists() or (HERE / name).read_bytes() != build(name)]
    for name in stale:
        print(f"{name}: the writer's output differs from the committed file")
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
