"""Peak memory and throughput of prefilling a 4k-token suffix in one shot vs in chunks.

Each configuration runs in its own process, so the peak (process max RSS on CPU,
torch.cuda.max_memory_allocated on GPU) belongs to that configuration alone. Side by side in
one run; ratios are what to read, not absolute seconds.

    .venv/bin/python benchmarks/chunked.py [--tokens 4096] [--chunks 128 256 512 1024 2048 4096]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import describe, machine, table, write_json  # noqa: E402

_CHILD = """
import json, resource, sys, time
sys.path.insert(0, {root!r})
import torch
from benchmarks.common import document
from kvsnap.models import load_model
from kvsnap.session import Session
lm = load_model({model!r}, device={device!r})
ids = document(lm.tokenizer, {tokens})
Session(lm).prefill(ids[:64])  # warm up
cuda = lm.device.type == "cuda"
if cuda:
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
session = Session(lm, chunk_size={chunk})
t0 = time.perf_counter()
session.prefill(ids)
if cuda:
    torch.cuda.synchronize()
seconds = time.perf_counter() - t0
peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
kv = {tokens} * lm.layout.bytes_per_token
print(json.dumps({{"seconds": seconds, "peak_bytes": peak, "base_bytes": base * 1024, "cuda": cuda, "kv_bytes": kv}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chunks", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    root = str(Path(__file__).resolve().parent.parent)
    rows = []
    for chunk in args.chunks:
        code = _CHILD.format(root=root, model=args.model, device=args.device, tokens=args.tokens, chunk=chunk)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        # On CPU the peak includes the model and the KV; what the chunking changes is the rest.
        over = r["peak_bytes"] - (0 if r["cuda"] else r["base_bytes"])
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
        print(f"  chunk {chunk}: {r['seconds']:.1f} s", file=sys.stderr)
    one_shot = next((r for r in rows if r["chunk"] >= args.tokens), rows[-1])
    for r in rows:
        r["peak_vs_one_shot"] = r["over_base_mb"] / one_shot["over_base_mb"]
        r["speed_vs_one_shot"] = r["tok_s"] / one_shot["tok_s"]
        r["beyond_kv_vs_one_shot"] = r["beyond_kv_mb"] / one_shot["beyond_kv_mb"]
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
    print(f"{args.tokens}-token prefill of {args.model}, each chunk size in its own process")
    print(table(rows, cols))
    print(f"wrote {write_json('chunked', {'machine': info, 'tokens': args.tokens, 'rows': rows})}")


if __name__ == "__main__":
    main()
