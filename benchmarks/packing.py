"""What packing the linear weights for oneDNN buys (kvsnap/models/packing.py), side by side in one run.

Two copies of the model in one process, one packed: per length, a 32-token suffix forward over a
prefix already in the cache (the floor of a resume), a chunk of a cold prefill and one-token
decode steps, alternating between the two many times; then ``torch.profiler`` over a few suffix
forwards of each, for the time in the linear layers (``aten::mm`` against
``mkldnn::_linear_pointwise``) and in attention. Also: how long the packing took and how much memory it added.

    .venv/bin/python benchmarks/packing.py [--lengths 512 2048 4096] [--repeats 25]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import describe, document, machine, model_arguments, table, write_json  # noqa: E402
from kvsnap.engine.prepare import forward_kind, start_packing  # noqa: E402
from kvsnap.engine.session import Session  # noqa: E402
from kvsnap.models import load_model  # noqa: E402

SUFFIX = 32
# aten::bmm: the unpacked lm_head's one row (attention here is the SDPA kernel, not a bmm).
LINEAR_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise")
DECODE_STEPS = 4
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu",)


def rss_anon_mb() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def profile_ms(session: Session, ids: list[int], start: int, runs: int = 3) -> dict[str, float]:
    """Self CPU milliseconds per forward in the linear layers and in attention."""
    import torch

    with torch.profiler.profile() as prof:
        for _ in range(runs):
            session.runner.forward(session.cache, ids[start:], start)
            session.cache.crop(start)
    totals = {"linear": 0.0, "attention": 0.0}
    for event in prof.key_averages():
        kind = "linear" if event.key in LINEAR_OPS else "attention" if event.key in ATTENTION_OPS else None
        if kind is not None:
            totals[kind] += event.self_cpu_time_total / 1000 / runs
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096])
    parser.add_argument("--chunk", type=int, default=256, help="tokens of the cold prefill chunk timed")
    model_arguments(parser)
    parser.set_defaults(repeats=25)
    args = parser.parse_args()
    plain = load_model(args.model, device="cpu", dtype=args.dtype)
    before = rss_anon_mb()
    packed = load_model(args.model, device="cpu", dtype=args.dtype)
    t0 = time.perf_counter()
    if not start_packing(packed):
        raise SystemExit(f"nothing to compare: {forward_kind(packed)}")
    packed.model.packing.wait()
    pack_s = time.perf_counter() - t0
    if packed.model.packing.error is not None:
        raise SystemExit(f"packing failed: {packed.model.packing.error}")
    after = rss_anon_mb()
    models = {"unpacked": plain, "packed": packed}
    rows = []
    for n in args.lengths:
        ids = document(plain.tokenizer, n)
        start = n - SUFFIX
        sessions = {}
        for name, lm in models.items():
            sessions[name] = Session(lm)
            sessions[name].prefill(ids[:start])
        suffix: dict[str, list[float]] = {name: [] for name in models}
        chunk: dict[str, list[float]] = {name: [] for name in models}
        decode: dict[str, list[float]] = {name: [] for name in models}
        first = max(0, start - args.chunk)
        for _ in range(args.repeats + 1):  # the first round warms up: not kept
            for name, s in sessions.items():
                t = time.perf_counter()
                s.runner.forward(s.cache, ids[start:], start)
                suffix[name].append(time.perf_counter() - t)
                t = time.perf_counter()
                for j in range(DECODE_STEPS):  # one-row forwards, as a decode step runs them
                    s.runner.forward(s.cache, [ids[j]], n + j)
                decode[name].append((time.perf_counter() - t) / DECODE_STEPS)
                s.cache.crop(first)  # a cold prefill's chunk: the tokens before `start`, over what precedes them
                t = time.perf_counter()
                s.runner.forward(s.cache, ids[first:start], first)
                chunk[name].append(time.perf_counter() - t)
        row = {"tokens": n, "chunk_tokens": start - first}
        for name in models:
            row[f"{name}_suffix_s"] = statistics.median(suffix[name][1:])
            row[f"{name}_suffix_min_s"] = min(suffix[name][1:])
            row[f"{name}_chunk_s"] = statistics.median(chunk[name][1:])
            row[f"{name}_decode_s"] = statistics.median(decode[name][1:])
            profiled = profile_ms(sessions[name], ids, start)
            row[f"{name}_linear_ms"], row[f"{name}_attention_ms"] = profiled["linear"], profiled["attention"]
        row["suffix_ratio"] = row["packed_suffix_s"] / row["unpacked_suffix_s"]
        row["chunk_ratio"] = row["packed_chunk_s"] / row["unpacked_chunk_s"]
        row["decode_ratio"] = row["packed_decode_s"] / row["unpacked_decode_s"]
        row["linear_ratio"] = row["packed_linear_ms"] / row["unpacked_linear_ms"]
        rows.append(row)
        print(f"  {n}: suffix {row['unpacked_suffix_s']:.3f} s -> {row['packed_suffix_s']:.3f} s", file=sys.stderr)
    cols = [
        ("tokens", "tokens", "d"),
        ("unpacked_suffix_s", "suffix, unpacked s", ".3f"),
        ("packed_suffix_s", "suffix, packed s", ".3f"),
        ("suffix_ratio", "packed/unpacked", ".2f"),
        ("unpacked_suffix_min_s", "min, unpacked s", ".3f"),
        ("packed_suffix_min_s", "min, packed s", ".3f"),
        ("unpacked_linear_ms", "linear ms, unpacked", ".1f"),
        ("packed_linear_ms", "linear ms, packed", ".1f"),
        ("linear_ratio", "linear packed/unpacked", ".2f"),
        ("unpacked_attention_ms", "attention ms", ".1f"),
        ("chunk_tokens", "prefill chunk", "d"),
        ("unpacked_chunk_s", "chunk, unpacked s", ".3f"),
        ("packed_chunk_s", "chunk, packed s", ".3f"),
        ("chunk_ratio", "chunk packed/unpacked", ".2f"),
        ("unpacked_decode_s", "decode step, unpacked s", ".4f"),
        ("packed_decode_s", "decode step, packed s", ".4f"),
        ("decode_ratio", "decode packed/unpacked", ".2f"),
    ]
    info = machine()
    print(describe(info))
    added = f"{after - before:.0f} MB" if before is not None and after is not None else "unknown"
    print(
        f"model {args.model} {packed.layout.dtype}; packing took {pack_s:.2f} s and added {added} of memory; "
        f"{SUFFIX}-token suffix; median of {args.repeats}, alternating; profile: self CPU per forward"
    )
    print(table(rows, cols))
    payload = {"machine": info, "model": args.model, "pack_s": pack_s, "rows": rows}
    payload["added_mb"] = after - before if before is not None and after is not None else None
    path = write_json("packing", payload)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
