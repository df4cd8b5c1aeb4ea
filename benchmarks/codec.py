"""Snapshot codecs on real KV: stored size vs raw and decode speed, per KV dtype, side by side.

The KV comes from the default model prefilling a 2k-token document in each dtype (float32,
bfloat16, float16). For every codec: bytes stored / raw bytes, encode and decode throughput of
one thread over all blocks.

    .venv/bin/python benchmarks/codec.py [--tokens 2048] [--block-size 64]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import describe, document, machine, table, write_json  # noqa: E402
from kvsnap.engine.session import Session  # noqa: E402
from kvsnap.format import codec as codecs  # noqa: E402
from kvsnap.models import load_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"])
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    rows = []
    for dtype in args.dtypes:
        lm = load_model(args.model, device="cpu", dtype=dtype)
        session = Session(lm)
        session.prefill(document(lm.tokenizer, args.tokens))
        bs = args.block_size
        raws = [session.cache.block_raw(s, min(s + bs, args.tokens)).copy() for s in range(0, args.tokens, bs)]
        raw_bytes = sum(r.size for r in raws)
        # The default's design choice, measured: a byte plane is stored compressed only where that
        # saves 3%; "every plane" compresses all of them (the same format, another threshold).
        variants = [(c, c, codecs._WORTH) for c in codecs.CODECS]
        variants.insert(1, ("shuffle-zstd", "shuffle-zstd, every plane", float("inf")))
        for codec, label, worth in variants:
            codecs._WORTH = worth
            try:
                t0 = time.perf_counter()
                stored = [codecs.encode(r, lm.layout.itemsize, codec) for r in raws]
                t1 = time.perf_counter()
            finally:
                codecs._WORTH = variants[0][2]
            for r, s in zip(raws, stored):
                codecs.decode(s, r.size, lm.layout.itemsize, codec)
            t2 = time.perf_counter()
            rows.append(
                {
                    "dtype": dtype,
                    "codec": label,
                    "ratio": sum(len(s) for s in stored) / raw_bytes,
                    "encode_mb_s": raw_bytes / (t1 - t0) / 1e6,
                    "decode_mb_s": raw_bytes / (t2 - t1) / 1e6,
                    "raw_mb": raw_bytes / 1e6,
                }
            )
        print(f"  {dtype} done", file=sys.stderr)
    cols = [
        ("dtype", "KV dtype", "s"),
        ("codec", "codec", "s"),
        ("raw_mb", "raw MB", ".1f"),
        ("ratio", "stored/raw", ".3f"),
        ("encode_mb_s", "encode MB/s", ",.0f"),
        ("decode_mb_s", "decode MB/s", ",.0f"),
    ]
    info = machine()
    print(describe(info))
    print(f"{args.tokens} tokens of {args.model} KV, blocks of {args.block_size}, one thread")
    print(table(rows, cols))
    print(f"wrote {write_json('codec', {'machine': info, 'tokens': args.tokens, 'rows': rows})}")


if __name__ == "__main__":
    main()
