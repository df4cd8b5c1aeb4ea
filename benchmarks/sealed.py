"""What encryption at rest costs a restore: the same snapshot plain and sealed (AES-256-GCM), restored
in one process, alternating, plus the save of each.

For each length: the default model prefills a document, saves it plain and sealed (a fresh key),
then each repeat restores both into a new session (``Session.restore``: read, open each sealed
piece, checksum, decode into the KV buffer). Median of the repeats after one warm-up round.

    .venv/bin/python benchmarks/sealed.py                      # 2048 4096 8192
    .venv/bin/python benchmarks/sealed.py --lengths 1024 --repeats 3
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

from benchmarks.common import describe, document, machine, model_arguments, table, write_json  # noqa: E402
from kvsnap.engine.session import Session  # noqa: E402
from kvsnap.models import load_model  # noqa: E402
from kvsnap.sealing import write_key_file  # noqa: E402


def measure(lm, n: int, repeats: int, folder: Path, key) -> dict:
    ids = document(lm.tokenizer, n)
    primer = Session(lm)
    primer.prefill(ids)
    paths = {"plain": folder / f"doc{n}.kv", "sealed": folder / f"doc{n}-sealed.kv"}
    key.seal(b"", b"")  # cryptography's one-time import is not the saves' cost
    save_s = {}
    for name, path in paths.items():
        primer.config = dataclasses.replace(primer.config, key=key if name == "sealed" else None)
        primer.encoded = type(primer.encoded)()  # a full save: every block encoded (and sealed) now
        t0 = time.perf_counter()
        primer.save(path)
        save_s[name] = time.perf_counter() - t0
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats + 1):  # the first round warms the pool and the page cache: not kept
        for name, path in paths.items():
            session = Session(lm, dataclasses.replace(primer.config, key=key))
            t0 = time.perf_counter()
            session.restore(path, ids)
            times[name].append(time.perf_counter() - t0)
            assert session.tokens == ids[: len(session.tokens)] and len(session.tokens) >= n - lm.layout.num_layers
            session = None  # dropped after the timing, so its buffer goes back to the pool
    row = {"tokens": n, "file_mb": paths["plain"].stat().st_size / 1e6}
    row["sealed_file_mb"] = paths["sealed"].stat().st_size / 1e6
    for name, values in times.items():
        values = values[1:]
        row[f"{name}_restore_s"] = statistics.median(values)
        row[f"{name}_spread_s"] = max(values) - min(values)
        row[f"{name}_save_s"] = save_s[name]
    row["restore_ratio"] = row["sealed_restore_s"] / row["plain_restore_s"]
    row["save_ratio"] = row["sealed_save_s"] / row["plain_save_s"]
    print(
        f"  {n} tokens: plain {row['plain_restore_s']:.3f} s, sealed {row['sealed_restore_s']:.3f} s", file=sys.stderr
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    model_arguments(parser)
    args = parser.parse_args()
    lm = load_model(args.model, device="cpu", dtype=args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        key = write_key_file(Path(tmp) / "key")
        rows = [measure(lm, n, args.repeats, Path(tmp), key) for n in args.lengths]
    cols = [
        ("tokens", "tokens", "d"),
        ("file_mb", "file MB", ".1f"),
        ("sealed_file_mb", "sealed MB", ".1f"),
        ("plain_restore_s", "restore s", ".3f"),
        ("sealed_restore_s", "sealed restore s", ".3f"),
        ("restore_ratio", "sealed/plain", ".2f"),
        ("plain_save_s", "save s", ".3f"),
        ("sealed_save_s", "sealed save s", ".3f"),
        ("save_ratio", "save sealed/plain", ".2f"),
    ]
    info = machine()
    print(describe(info))
    print(
        f"model {args.model}, cpu, {lm.layout.dtype}, {os.cpu_count()} cores, "
        f"median of {args.repeats} (alternating, after one warm-up round)"
    )
    print(table(rows, cols))
    path = write_json("sealed", {"machine": info, "model": args.model, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
