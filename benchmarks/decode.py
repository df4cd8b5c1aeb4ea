"""Decode speed side by side with llama.cpp: tokens per second after a context, same GGUF, same prompt.

For each context length a document of that many tokens is prefilled, then 64 tokens are decoded
greedily (``--new-tokens``); only the decode is timed. kvsnap runs each ``--variant`` (a dtype, with
or without packed weights, a weight quantization where the build has one: ``float32``,
``float32-unpacked``, ``bfloat16``, ...), llama.cpp the GGUF as it is (via ``llama-cpp-python``, all
cores, f16 KV). Runs alternate between the engines; median and spread of ``--repeats`` are reported.

llama-cpp-python is not a kvsnap dependency; build it in its own folder and point at it:

    python3 -m venv /tmp/llvenv && /tmp/llvenv/bin/pip install llama-cpp-python
    .venv/bin/python benchmarks/decode.py --llama-site /tmp/llvenv/lib/python3.11/site-packages

Without ``--llama-site`` only kvsnap's variants run (a smoke test, or a machine without llama.cpp).
``--no-extra-bufts`` runs llama.cpp without its repacked/AMX weight buffers, where its AMX kernel crashes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import describe, document, machine, table, write_json  # noqa: E402
from kvsnap.config import DEFAULT_MODEL, SamplingParams  # noqa: E402
from kvsnap.engine.prepare import forward_kind, start_packing  # noqa: E402
from kvsnap.engine.session import Session  # noqa: E402
from kvsnap.models import load_model  # noqa: E402

# A variant: (dtype, pack the weights). Quantized variants join this table where the build has them.
VARIANTS = {
    "float32": ("float32", True),
    "float32-unpacked": ("float32", False),
    "bfloat16": ("bfloat16", True),
}


def kvsnap_decode(lm, ids: list[int], new_tokens: int) -> tuple[float, int]:
    """Tokens per second of a greedy decode after ``ids`` (prefill not timed), and the tokens made."""
    session = Session(lm)
    session.prefill(ids)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, stop_loops=False)
    t0 = time.perf_counter()
    gen = session.generate(params)
    seconds = time.perf_counter() - t0
    # The first token comes from the prefill's logits; every later one cost a forward.
    return (len(gen.token_ids) - 1) / seconds, len(gen.token_ids)


class LlamaCppDecode:
    def __init__(self, site: str, n_ctx: int, extra_bufts: bool):
        from benchmarks.llamacpp import LlamaCpp

        self.cpp = LlamaCpp(site, n_ctx=n_ctx, extra_bufts=extra_bufts)

    def decode(self, ids: list[int], new_tokens: int) -> tuple[float, int]:
        cpp = self.cpp
        cpp.clear()
        cpp.llm.eval(ids)
        token = cpp.first_token()
        t0 = time.perf_counter()
        for _ in range(new_tokens - 1):
            cpp.llm.eval([token])
            token = cpp.first_token()
        seconds = time.perf_counter() - t0
        return (new_tokens - 1) / seconds, new_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variant", nargs="+", choices=sorted(VARIANTS), default=["float32", "bfloat16"])
    parser.add_argument("--llama-site", help="site-packages folder holding llama_cpp (omit: kvsnap only)")
    parser.add_argument("--no-extra-bufts", action="store_true", help="llama.cpp without AMX/repacked buffers")
    args = parser.parse_args()

    models = {}
    for name in args.variant:
        dtype, pack = VARIANTS[name]
        lm = load_model(args.model, device="cpu", dtype=dtype)
        if pack:
            start_packing(lm)
        kvsnap_decode(lm, document(lm.tokenizer, 32), 4)  # warm up (and wait for the packing)
        models[name] = lm
    any_lm = next(iter(models.values()))
    cpp = None
    if args.llama_site:
        cpp = LlamaCppDecode(args.llama_site, max(args.lengths) + args.new_tokens + 8, not args.no_extra_bufts)
        cpp.decode(document(any_lm.tokenizer, 32), 4)
    engines = {
        f"kvsnap {name}": (lambda ids, lm=lm: kvsnap_decode(lm, ids, args.new_tokens)) for name, lm in models.items()
    }
    if cpp is not None:
        engines["llama.cpp"] = lambda ids: cpp.decode(ids, args.new_tokens)

    rows, runs = [], []
    for n in args.lengths:
        ids = document(any_lm.tokenizer, n)
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for r in range(args.repeats):
            order = list(engines) if r % 2 == 0 else list(reversed(engines))  # alternate who goes first
            for name in order:
                rate, made = engines[name](ids)
                rates[name].append(rate)
                runs.append({"tokens": n, "engine": name, "repeat": r, "tok_per_s": rate, "new_tokens": made})
        row = {"context": n}
        for name, values in rates.items():
            row[name] = f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"
        if cpp is not None:
            base = statistics.median(rates["llama.cpp"])
            for name in models:
                row[f"kvsnap {name} / llama.cpp"] = f"{statistics.median(rates['kvsnap ' + name]) / base:.2f}"
        rows.append(row)

    info = machine()
    print(describe(info))
    kinds = ", ".join(f"{name}: {forward_kind(lm)}" for name, lm in models.items())
    print(
        f"decode tokens/s after a context, {args.new_tokens} greedy tokens, median (min-max) of {args.repeats}; {kinds}"
    )
    columns = [("context", "context", "d")] + [(k, k, "s") for k in rows[0] if k != "context"]
    print(table(rows, columns))
    payload = {"machine": info, "model": args.model, "new_tokens": args.new_tokens, "rows": rows, "runs": runs}
    print(f"wrote {write_json('decode', payload)}")


if __name__ == "__main__":
    main()
