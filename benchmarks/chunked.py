"""Peak memory and throughput of prefilling a 4k-token suffix in one shot vs in chunks.

The peak of each configuration is read in its own process, so it belongs to that prefill alone
(the process's peak RSS on CPU, reset after the model is loaded; torch.cuda.max_memory_allocated
on GPU). Throughput is timed in one process with the configurations alternating. Side by side in
one run; ratios are what to read, not absolute seconds.

    .venv/bin/python benchmarks/chunked.py [--tokens 4096] [--chunks 128 256 512 1024 2048 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import best_of_each, describe, document, kept, machine, run_child, synced, table, write_json  # noqa: E402
from kvsnap.engine.session import Session  # noqa: E402
from kvsnap.models import load_model  # noqa: E402

_CHILD = """
import json, resource, sys, time
sys.path.insert(0, {root!r})
import torch
from benchmarks.common import document
from kvsnap.models import load_model
from kvsnap.engine.session import Session
lm = load_model({model!r}, device={device!r})
ids = document(lm.tokenizer, {tokens})
Session(lm).prefill(ids[:64])  # warm up
cuda = lm.device.type == "cuda"
if cuda:
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
def status_bytes(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
def reset_peak():
    # Linux: forget the peak so far (model loading), so the peak read after is the prefill's.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
exact = not cuda and reset_peak()
if cuda:
    base = torch.cuda.memory_allocated()  # the model's weights
else:
    base = status_bytes("VmRSS") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
session = Session(lm, chunk_size={chunk})
t0 = time.perf_counter()
session.prefill(ids)
if cuda:
    torch.cuda.synchronize()
seconds = time.perf_counter() - t0
if cuda:
    peak = torch.cuda.max_memory_allocated()
else:
    peak = status_bytes("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
kv = {tokens} * lm.layout.bytes_per_token
print(json.dumps({{"seconds": seconds, "peak_bytes": peak, "base_bytes": base, "cuda": cuda, "kv_bytes": kv}}))
"""


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None  # a tiny prefill can leave nothing measurable beyond the base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chunks", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per chunk size (alternating)")
    args = parser.parse_args()
    root = str(Path(__file__).resolve().parent.parent)
    # glibc keeps freed memory mapped for reuse, so a process's peak RSS says more about its
    # allocator's history than about the tensors alive at once. With a fixed mmap threshold every
    # large buffer is returned when freed and the peak follows live memory (on CPU; the GPU
    # reading is torch's own count). Same setting for every configuration.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    best: dict[int, dict] = {}
    for chunk in args.chunks:
        code = _CHILD.format(root=root, model=args.model, device=args.device, tokens=args.tokens, chunk=chunk)
        best[chunk] = json.loads(run_child(code, env))
        print(f"  chunk {chunk}: peak {best[chunk]['peak_bytes'] / 1e6:,.0f} MB", file=sys.stderr)
    # Throughput in this process, with the allocator as users have it, the chunk sizes alternating
    # so that a slow spell of a shared machine falls on all of them; the best run of each counts.
    lm = load_model(args.model, device=args.device)
    ids = document(lm.tokenizer, args.tokens)
    Session(lm).prefill(ids[:64])  # warm up
    timed = best_of_each(
        args.repeats,
        # Each returns its session, so freeing the cache is not timed.
        {
            chunk: synced(lm.device, lambda c=chunk: kept(Session(lm, chunk_size=c), "prefill", ids))
            for chunk in args.chunks
        },
    )
    for chunk in args.chunks:
        best[chunk]["seconds"] = timed[chunk][0]
        print(f"  chunk {chunk}: {timed[chunk][0]:.1f} s", file=sys.stderr)
    rows = []
    for chunk in args.chunks:
        r = best[chunk]
        # The peak over what was there before (the model); it includes the KV, which chunking cannot change.
        over = r["peak_bytes"] - r["base_bytes"]
        rows.append(
            {
                "chunk": chunk,
                "seconds": r["seconds"],
                "tok_s": args.tokens / r["seconds"],
                "peak_mb": r["peak_bytes"] / 1e6,
                "over_base_mb": over / 1e6,
                # What chunking can change: the peak beyond the KV cache the prefill must build anyway.
                "beyond_kv_mb": (over - r["kv_bytes"]) / 1e6,
            }
        )
    one_shot = next((r for r in rows if r["chunk"] >= args.tokens), rows[-1])
    for r in rows:
        r["peak_vs_one_shot"] = _ratio(r["over_base_mb"], one_shot["over_base_mb"])
        r["speed_vs_one_shot"] = _ratio(r["tok_s"], one_shot["tok_s"])
        r["beyond_kv_vs_one_shot"] = _ratio(r["beyond_kv_mb"], one_shot["beyond_kv_mb"])
    cols = [
        ("chunk", "chunk", "d"),
        ("seconds", "prefill s", ".2f"),
        ("tok_s", "tok/s", ",.0f"),
        ("peak_mb", "peak MB", ",.0f"),
        ("over_base_mb", "peak over base MB", ",.0f"),
        ("peak_vs_one_shot", "vs one shot", ".2f"),
        ("beyond_kv_mb", "beyond KV MB", ",.0f"),
        ("beyond_kv_vs_one_shot", "vs one shot", ".2f"),
        ("speed_vs_one_shot", "speed vs one shot", ".2f"),
    ]
    info = machine()
    print(describe(info))
    print(f"{args.tokens}-token prefill of {args.model}: peak memory of each chunk size in its own process,")
    print(f"throughput in one process, the chunk sizes alternating, best of {args.repeats}")
    print(table(rows, cols))
    print(f"wrote {write_json('chunked', {'machine': info, 'tokens': args.tokens, 'rows': rows})}")


if __name__ == "__main__":
    main()
