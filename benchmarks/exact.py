"""What a batch-invariant forward costs (``--exact``, kvsnap/models/exact.py), side by side in one run.

Per dtype, one model, two sessions: the plain forward and the exact one. Per length, a cold prefill of
that many tokens in the default chunks (512), then one-token decode steps after it; alternating between
the two, best of ``--repeats``. ``--check`` also prefills each length in chunks of 97 and says whether
the KV is bitwise the one the default chunks made (the exact forward's must be).

    .venv/bin/python benchmarks/exact.py [--lengths 512 2048] [--dtypes float32 bfloat16] [--repeats 3] [--check]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import best_of_each, describe, document, kept, machine, table, write_json  # noqa: E402
from kvsnap.config import DEFAULT_CHUNK_SIZE  # noqa: E402
from kvsnap.engine.prepare import forward_kind  # noqa: E402
from kvsnap.engine.session import Session  # noqa: E402
from kvsnap.models import load_model  # noqa: E402

ODD_CHUNK = 97  # a chunk size that divides nothing here
MODES = ("plain", "exact")


def cold_prefill(lm, ids: list[int], chunk: int, exact: bool) -> Session:
    return kept(Session(lm, chunk_size=chunk, exact=exact), "prefill", ids)


def decode_step_s(session: Session, steps: int) -> float:
    """Mean seconds of a one-token forward after the session's tokens (the cache is cut back after)."""
    start = session.num_tokens
    t0 = time.perf_counter()
    for j in range(steps):
        session.runner.forward(session.cache, [session.tokens[j]], start + j)
    seconds = (time.perf_counter() - t0) / steps
    session.cache.crop(start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--chunk", type=int, default=DEFAULT_CHUNK_SIZE)
    parser.add_argument("--decode-steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--check", action="store_true", help="also compare the KV of another chunking")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's, one per core)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for dtype in args.dtypes:
        lm = load_model(args.model, device="cpu", dtype=dtype)
        kind = forward_kind(lm)
        Session(lm).prefill(document(lm.tokenizer, 64))  # warm up
        for n in args.lengths:
            ids = document(lm.tokenizer, n)
            runs = {mode: functools.partial(cold_prefill, lm, ids, args.chunk, mode == "exact") for mode in MODES}
            timed = best_of_each(args.repeats, runs)
            row = {"dtype": dtype, "tokens": n, "forward": kind}
            for mode, (seconds, sessions) in timed.items():
                row[f"{mode}_prefill_s"] = seconds
                row[f"{mode}_decode_s"] = decode_step_s(sessions[-1], args.decode_steps)
            row["prefill_ratio"] = row["exact_prefill_s"] / row["plain_prefill_s"]
            row["decode_ratio"] = row["exact_decode_s"] / row["plain_decode_s"]
            if args.check:
                for mode, (_, sessions) in timed.items():
                    other = kept(Session(lm, chunk_size=ODD_CHUNK, exact=mode == "exact"), "prefill", ids)
                    row[f"{mode}_invariant"] = bool((other.cache.span(0, n) == sessions[-1].cache.span(0, n)).all())
            rows.append(row)
            print(
                f"  {dtype} {n}: prefill {row['plain_prefill_s']:.2f} -> {row['exact_prefill_s']:.2f} s",
                file=sys.stderr,
            )
    cols = [
        ("dtype", "dtype", "s"),
        ("tokens", "tokens", "d"),
        ("plain_prefill_s", "prefill s", ".3f"),
        ("exact_prefill_s", "prefill exact s", ".3f"),
        ("prefill_ratio", "exact/plain", ".2f"),
        ("plain_decode_s", "decode step s", ".4f"),
        ("exact_decode_s", "decode step exact s", ".4f"),
        ("decode_ratio", "exact/plain", ".2f"),
    ]
    if args.check:
        cols += [("plain_invariant", f"plain KV = chunks of {ODD_CHUNK}", ""), ("exact_invariant", "exact KV =", "")]
    info = machine()
    print(describe(info))
    print(
        f"model {args.model}, forward: {rows[0]['forward'] if rows else '-'}; cold prefill in chunks of {args.chunk}, "
        f"then {args.decode_steps} decode steps; best of {args.repeats}, alternating"
    )
    print(table(rows, cols))
    path = write_json("exact", {"machine": info, "model": args.model, "chunk": args.chunk, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
