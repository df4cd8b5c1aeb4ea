"""What each restore lever buys: a plain read vs restores with the arena and direct decode on or off.

For each length, one real snapshot per codec (the default lossless shuffle-zstd, and raw); in one
process, alternating, each repeat times:

- "read": the .kv file read into a buffer already touched (the memory-speed floor of any restore);
- "before": a restore as kvsnap did before these levers: a fresh KV buffer (page faults), every
  block decoded into a scratch buffer and copied into the cache;
- "arena": the KV buffer from the process's pool (pages already mapped), scratch decode;
- "now": the pool and blocks decoded straight into their slice of the buffer (the default).

    .venv/bin/python benchmarks/restore_levers.py                      # 2048 4096 8192
    .venv/bin/python benchmarks/restore_levers.py --lengths 1024 --repeats 3
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from benchmarks.common import describe, document, machine, model_arguments, table, write_json  # noqa: E402
from kvsnap.engine import arena  # noqa: E402
from kvsnap.engine.kv_transfer import KVTransfer  # noqa: E402
from kvsnap.engine.session import Session  # noqa: E402
from kvsnap.models import load_model  # noqa: E402

_direct = KVTransfer.target


def _scratch_only(self, start, block_tokens):
    return None


def variant(name: str) -> None:
    arena.ENABLED = name != "before"
    if name == "before":
        arena.clear()
    KVTransfer.target = _direct if name == "now" else _scratch_only


def measure(lm, n: int, repeats: int, folder: Path) -> list[dict]:
    ids = document(lm.tokenizer, n)
    primer = Session(lm)
    primer.prefill(ids)
    rows = []
    for codec in ("shuffle-zstd", "raw"):
        path = folder / f"doc{n}-{codec}.kv"
        primer.config = dataclasses.replace(primer.config, codec=codec)
        primer.encoded = type(primer.encoded)()  # a full first save in this codec
        primer.save(path)
        size = path.stat().st_size
        ready = np.empty(size, dtype=np.uint8)
        ready.fill(1)

        def read(path=path, ready=ready):
            with open(path, "rb", buffering=0) as fh:
                fh.readinto(memoryview(ready))

        times: dict[str, list[float]] = {k: [] for k in ("read", "before", "arena", "now")}
        for _ in range(repeats + 1):  # the first round warms the pool and the page cache: not kept
            for name in times:
                if name != "read":
                    variant(name)
                t0 = time.perf_counter()
                if name == "read":
                    read()
                else:
                    kept = Session(lm)
                    kept.restore(path, ids)
                times[name].append(time.perf_counter() - t0)
                kept = None  # noqa: F841  (dropped after the timing, so its buffer goes back to the pool)
        variant("now")
        row = {"tokens": n, "codec": codec, "file_mb": size / 1e6}
        for name, values in times.items():
            values = values[1:]
            row[f"{name}_s"] = statistics.median(values)
            row[f"{name}_spread_s"] = max(values) - min(values)
        for name in ("before", "arena", "now"):
            row[f"{name}_vs_read"] = row[f"{name}_s"] / row["read_s"]
        rows.append(row)
        print(f"  {n} tokens, {codec}: now {row['now_s']:.3f} s, read {row['read_s']:.3f} s", file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    model_arguments(parser)
    args = parser.parse_args()
    lm = load_model(args.model, device="cpu", dtype=args.dtype)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.lengths:
            rows.extend(measure(lm, n, args.repeats, Path(tmp)))
    cols = [
        ("tokens", "tokens", "d"),
        ("codec", "codec", "s"),
        ("file_mb", "file MB", ".0f"),
        ("read_s", "plain read s", ".3f"),
        ("before_s", "before s", ".3f"),
        ("arena_s", "+arena s", ".3f"),
        ("now_s", "+direct decode s", ".3f"),
        ("before_vs_read", "before/read", ".2f"),
        ("arena_vs_read", "+arena/read", ".2f"),
        ("now_vs_read", "now/read", ".2f"),
        ("now_spread_s", "now spread s", ".3f"),
    ]
    info = machine()
    print(describe(info))
    print(
        f"model {args.model}, cpu, {lm.layout.dtype}, {os.cpu_count()} cores, "
        f"median of {args.repeats} (alternating, after one warm-up round)"
    )
    print(table(rows, cols))
    path = write_json("restore_levers", {"machine": info, "model": args.model, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
