"""Loading a prefix vs recomputing it, by prompt length: where does loading stop paying?

For each length the same tokens are (a) prefilled by the model from nothing and (b) restored from
a ``.kv`` snapshot of them (read, checksum, decompress, cache build; on a GPU, the copy to the
device included). Runs alternate, best of ``--repeats``. On this CPU loading wins at every
length; on a fast GPU recomputing a short prefix can beat reading it, and the sweep says from
which length on loading is worth it.

    .venv/bin/python benchmarks/crossover.py [--lengths 16 64 256 1024 4096] [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    best_of_each,
    describe,
    document,
    kept,
    machine,
    model_arguments,
    synced,
    table,
    write_json,
)
from kvsnap.engine.session import Session  # noqa: E402
from kvsnap.models import load_model  # noqa: E402


def measure(lm, n: int, repeats: int, folder: Path, codec: str) -> dict:
    ids = document(lm.tokenizer, n, seed=n)
    snap = folder / f"prefix{n}.kv"
    primer = Session(lm, codec=codec)
    primer.prefill(ids)
    primer.save(snap)
    dev = lm.device
    times = best_of_each(
        repeats,
        {
            # Each returns its session, so freeing the cache is not timed.
            "recompute": synced(dev, lambda: kept(Session(lm), "prefill", ids)),
            "load": synced(dev, lambda: kept(Session(lm, codec=codec), "restore", snap, ids)),
        },
    )
    recompute_s, load_s = times["recompute"][0], times["load"][0]
    return {
        "tokens": n,
        "recompute_s": recompute_s,
        "load_s": load_s,
        "load_vs_recompute": load_s / recompute_s,
        "recompute_tok_s": n / recompute_s,
        "file_mb": snap.stat().st_size / 1e6,
    }


def _verdict(rows: list[dict]) -> str:
    """The length from which loading beats recomputing at every longer length measured."""
    wins = [r["load_s"] < r["recompute_s"] for r in rows]
    if all(wins):
        return f"loading wins at every length measured ({rows[0]['tokens']} to {rows[-1]['tokens']} tokens)"
    if not wins[-1]:
        return f"recomputing still wins at {rows[-1]['tokens']} tokens, the longest length measured"
    loss = max(i for i, w in enumerate(wins) if not w)
    return f"loading wins from {rows[loss + 1]['tokens']} tokens on; recomputing wins at {rows[loss]['tokens']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512, 1024, 2048, 4096])
    model_arguments(parser, codec=True)
    args = parser.parse_args()
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    Session(lm).prefill(document(lm.tokenizer, 64))  # warm up kernels and allocator
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.lengths:
            rows.append(measure(lm, n, args.repeats, Path(tmp), args.codec))
            print(f"  {n} tokens: load/recompute {rows[-1]['load_vs_recompute']:.3f}", file=sys.stderr)
    verdict = _verdict(rows)
    info = machine()
    print(describe(info))
    print(f"model {args.model}, {lm.device}, {lm.layout.dtype}, codec {args.codec}, best of {args.repeats}")
    cols = [
        ("tokens", "tokens", "d"),
        ("recompute_s", "recompute s", ".4f"),
        ("recompute_tok_s", "recompute tok/s", ",.0f"),
        ("load_s", "load s", ".4f"),
        ("load_vs_recompute", "load/recompute", ".3f"),
        ("file_mb", "file MB", ".1f"),
    ]
    print(table(rows, cols))
    print(verdict)
    payload = {"machine": info, "model": args.model, "dtype": lm.layout.dtype, "codec": args.codec}
    path = write_json("crossover", {**payload, "verdict": verdict, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
