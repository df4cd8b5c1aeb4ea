"""Decode speed side by side with llama.cpp: tokens per second after a context, same GGUF, same prompt.

For each context length a document of that many tokens is prefilled once per engine, then
``--new-tokens`` tokens (64) are decoded greedily from its end, ``--repeats`` times (3), each time from
the same prefilled context (the cache cut back to it); only the decode is timed. Both engines run
``--threads`` threads (2). Runs alternate between the engines (the order reversed every repeat); median
and spread are reported, and the load average of the machine around each run, since other jobs slow
both engines (llama.cpp's threads wait on each other, and on a descheduled one, far more than torch's).

kvsnap runs each ``--variant``: ``chat``, what ``kvsnap chat`` runs by default (``--dtype auto``,
``--quantize auto``: a Q4 GGUF in int4 on kvsnap's own kernel where it builds, float weights packed for
oneDNN otherwise); ``float32`` the float chat (``--quantize none``: packed weights, one-row products over
whichever weights measured faster, the one-token decode step); ``float32-before``: packed weights for
every product and the general forward for a decode step (``KVSNAP_PACK_ONE_ROW=packed
KVSNAP_DECODE_STEP=0``); ``float32-unpacked``, and ``float32-unpacked-general`` without the decode step;
``bfloat16`` (packed where the CPU has bfloat16 instructions); ``int8`` and ``int4`` (``--quantize``).
llama.cpp runs the GGUF as it is (via ``llama-cpp-python``, f16 KV).
``--profile`` adds a ``torch.profiler`` view of a decode step per variant: time per token,
operator calls per token, and where the time goes.

llama-cpp-python is not a kvsnap dependency; build it in its own folder and point at it:

    python3 -m venv /tmp/llvenv && /tmp/llvenv/bin/pip install llama-cpp-python
    .venv/bin/python benchmarks/decode.py --llama-site /tmp/llvenv/lib/python3.11/site-packages

Without ``--llama-site`` only kvsnap's variants run (a smoke test, or a machine without llama.cpp).
``--no-extra-bufts`` runs llama.cpp without its repacked/AMX weight buffers, where its AMX kernel crashes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import describe, document, machine, table, write_json  # noqa: E402
from kvsnap.config import DEFAULT_DTYPE, DEFAULT_MODEL, DEFAULT_QUANTIZE, SamplingParams  # noqa: E402
from kvsnap.engine.cache import KVCache, cache_for  # noqa: E402
from kvsnap.engine.prepare import forward_kind, start_packing  # noqa: E402
from kvsnap.engine.runner import Runner, generate  # noqa: E402
from kvsnap.models import decode_step, load_model, packing  # noqa: E402


@dataclass(frozen=True)
class Variant:
    dtype: str
    pack: bool
    one_row: str = "auto"  # packing.ONE_ROW while it packs
    step: bool = True  # the one-token decode step (decode_step.ENABLED)
    quantize: str = "none"  # --quantize (quantized models are never packed)


VARIANTS = {
    "chat": Variant(DEFAULT_DTYPE, True, quantize=DEFAULT_QUANTIZE),
    "float32": Variant("float32", True),
    "float32-before": Variant("float32", True, one_row="packed", step=False),
    "float32-unpacked": Variant("float32", False),
    "float32-unpacked-general": Variant("float32", False, step=False),
    "bfloat16": Variant("bfloat16", True),
    "int8": Variant("float32", False, quantize="int8"),
    "int4": Variant("float32", False, quantize="int4"),
}


class KvsnapDecode:
    """One variant's model, and a context prefilled once per length that every decode starts from."""

    def __init__(self, model: str, variant: Variant):
        self.variant = variant
        self.lm = load_model(model, device="cpu", dtype=variant.dtype, quantize=variant.quantize)
        if variant.pack:
            chosen, packing.ONE_ROW = packing.ONE_ROW, variant.one_row
            try:
                start_packing(self.lm)
                if self.lm.model.packing is not None:
                    self.lm.model.packing.wait()
            finally:
                packing.ONE_ROW = chosen
        self.runner = Runner(self.lm)
        self.cache: KVCache | None = None
        self.logits: torch.Tensor | None = None
        self.length = 0

    def prefill(self, ids: list[int]) -> None:
        self.cache = cache_for(self.lm)
        self.cache.reserve(len(ids) + 256, self.lm.layout, self.lm.device)
        self.logits = self.runner.forward(self.cache, ids, 0)
        self.length = len(ids)

    def decode(self, new_tokens: int) -> tuple[float, int]:
        """Tokens per second of a greedy decode from the prefilled context, and the tokens made."""
        self.cache.crop(self.length)
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0, stop_loops=False)
        with self.stepping():
            t0 = time.perf_counter()
            gen = generate(self.runner, self.cache, self.logits, self.length, params)
            seconds = time.perf_counter() - t0
        # The first token comes from the prefill's logits; every later one cost a forward.
        return (len(gen.token_ids) - 1) / seconds, len(gen.token_ids)

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        saved, decode_step.ENABLED = decode_step.ENABLED, self.variant.step
        try:
            yield
        finally:
            decode_step.ENABLED = saved

    def profile(self, new_tokens: int) -> dict[str, object]:
        """A profiled decode: ms and operator calls per token, and the operators that took the most time."""
        self.decode(4)  # warm
        with torch.profiler.profile() as prof:
            rate, made = self.decode(new_tokens)
        events = prof.key_averages()
        steps = made - 1
        top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:5]
        return {
            "ms_per_token": 1e3 / rate,
            "calls_per_token": sum(e.count for e in events) / steps,
            "top": [(e.key, e.self_cpu_time_total / 1e3 / steps) for e in top],
        }


class LlamaCppDecode:
    def __init__(self, site: str, n_ctx: int, extra_bufts: bool, threads: int):
        from benchmarks.llamacpp import LlamaCpp

        self.cpp = LlamaCpp(site, n_ctx=n_ctx, extra_bufts=extra_bufts, threads=threads)
        self.token = 0
        self.length = 0

    def prefill(self, ids: list[int]) -> None:
        cpp = self.cpp
        cpp.clear()
        cpp.llm.eval(ids)
        self.token, self.length = cpp.first_token(), len(ids)

    def decode(self, new_tokens: int) -> tuple[float, int]:
        cpp, token = self.cpp, self.token
        cpp.cut(self.length)
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
    parser.add_argument("--threads", type=int, default=2, help="threads of both engines")
    parser.add_argument("--variant", nargs="+", choices=sorted(VARIANTS), default=["chat", "float32"])
    parser.add_argument("--profile", action="store_true", help="also profile a decode step of each variant")
    parser.add_argument("--llama-site", help="site-packages folder holding llama_cpp (omit: kvsnap only)")
    parser.add_argument("--no-extra-bufts", action="store_true", help="llama.cpp without AMX/repacked buffers")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    engines: dict[str, KvsnapDecode | LlamaCppDecode] = {}
    for name in args.variant:
        engines[f"kvsnap {name}"] = KvsnapDecode(args.model, VARIANTS[name])
    tokenizer = next(iter(engines.values())).lm.tokenizer
    if args.llama_site:
        n_ctx = max(args.lengths) + args.new_tokens + 8
        engines["llama.cpp"] = LlamaCppDecode(args.llama_site, n_ctx, not args.no_extra_bufts, args.threads)
    warm = document(tokenizer, 32)
    for engine in engines.values():  # warm up (first calls allocate and fault pages in)
        engine.prefill(warm)
        engine.decode(4)

    rows, runs, profiles, loads = [], [], {}, []
    for n in args.lengths:
        ids = document(tokenizer, n)
        for engine in engines.values():
            engine.prefill(ids)
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for r in range(args.repeats):
            order = list(engines) if r % 2 == 0 else list(reversed(engines))  # alternate who goes first
            for name in order:
                before = os.getloadavg()[0]
                rate, made = engines[name].decode(args.new_tokens)
                load = (before + os.getloadavg()[0]) / 2
                loads.append(load)
                rates[name].append(rate)
                runs.append({"tokens": n, "engine": name, "repeat": r, "tok_per_s": rate, "new_tokens": made})
                runs[-1]["load_average"] = load
        row = {"context": n}
        for name, values in rates.items():
            row[name] = f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"
        if "llama.cpp" in engines:
            base = statistics.median(rates["llama.cpp"])
            for name in engines:
                if name != "llama.cpp":
                    row[f"{name} / llama.cpp"] = f"{statistics.median(rates[name]) / base:.2f}"
        rows.append(row)
        if args.profile and n == args.lengths[0]:
            for name, engine in engines.items():
                if isinstance(engine, KvsnapDecode):
                    profiles[name] = engine.profile(min(args.new_tokens, 17))

    info = machine()
    print(describe(info))
    kinds = ", ".join(
        f"{name}: {forward_kind(e.lm)}{'' if e.variant.step else ', general forward for a step'}"
        for name, e in engines.items()
        if isinstance(e, KvsnapDecode)
    )
    print(
        f"decode tokens/s after a context, {args.new_tokens} greedy tokens, {args.threads} threads, median (min-max) "
        f"of {args.repeats}; load average {min(loads):.1f}-{max(loads):.1f} (median {statistics.median(loads):.1f}) "
        f"on {os.cpu_count()} cores; {kinds}"
    )
    columns = [("context", "context", "d")] + [(k, k, "s") for k in rows[0] if k != "context"]
    print(table(rows, columns))
    for name, p in profiles.items():
        top = ", ".join(f"{key} {ms:.1f}" for key, ms in p["top"])
        print(f"profile {name}: {p['ms_per_token']:.1f} ms/token, {p['calls_per_token']:.0f} calls/token; ms: {top}")
    payload = {
        "machine": info,
        "model": args.model,
        "new_tokens": args.new_tokens,
        "threads": args.threads,
        "load_average": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
        "rows": rows,
        "runs": runs,
        "profiles": profiles,
    }
    print(f"wrote {write_json('decode', payload)}")


if __name__ == "__main__":
    main()
