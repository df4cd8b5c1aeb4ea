"""What a new process pays to load a quantized model: its first load (which quantizes and keeps the form) and
later ones (which map the kept form), against the float model and a bare ``import torch``.

Each cell is a new process: ``import torch`` and kvsnap, ``load_model(--quantize MODE)``, a first forward of
one token, then one of 512 tokens (every weight read); it reports the seconds from its start to the end of
the first forward (and that minus a bare ``import torch`` in a process of its own), the load's own seconds,
and the process's peak RSS over the 512-token forward too (VmHWM). The first
row of each mode runs with no kept form (it is removed first); the others map the one that run kept. Disk:
the kept form's bytes against the model folder's weight files (for a GGUF's conversion, the GGUF file too).

    .venv/bin/python benchmarks/quantized_load.py                      # the default model, 3 repeats
    .venv/bin/python benchmarks/quantized_load.py --model PATH --modes int8 int4 --repeats 5
    .venv/bin/python benchmarks/quantized_load.py --llama-site /tmp/llvenv/lib/python3.11/site-packages

``--llama-site``: llama.cpp (llama-cpp-python) loads the same GGUF in processes of its own, alternating with
kvsnap's: its model and context (``n_ctx`` 1,024, the threads torch has), one token evaluated, then the same
512 tokens; the same columns, ``import llama_cpp`` counted where kvsnap counts ``import torch``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import describe, machine, run_child, table, write_json  # noqa: E402

CHILD = """
import json, sys, time
t0 = time.perf_counter()
sys.path.insert(0, {root!r})
import torch
if {bare!r}:
    print(json.dumps({{"total_s": time.perf_counter() - t0}}))
    raise SystemExit
from kvsnap.models import load_model

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

t1 = time.perf_counter()
lm = load_model({model!r}, device="cpu", quantize={mode!r})
t2 = time.perf_counter()
with torch.inference_mode():
    lm.model(torch.tensor([[100]]))  # the first forward: one token
    t3 = time.perf_counter()
    lm.model(torch.arange(100, 100 + {tokens}).unsqueeze(0))  # every weight read, activations of a prompt
print(json.dumps({{"total_s": t3 - t0, "load_s": t2 - t1, "peak": status("VmHWM"),
                  "mapped": "mapped" in lm.load_timings, "quantization": getattr(lm.model, "quantization", "none")}}))
"""


LLAMA_CHILD = """
import json, sys, time
t0 = time.perf_counter()
sys.path.insert(0, {site!r})
import llama_cpp

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

t1 = time.perf_counter()
llm = llama_cpp.Llama(model_path={gguf!r}, n_ctx=1024, n_threads={threads}, n_threads_batch={threads}, n_batch=512,
                      verbose=False)
t2 = time.perf_counter()
llm.eval([100])
t3 = time.perf_counter()
llm.reset()
llm.eval(list(range(100, 100 + {tokens})))
print(json.dumps({{"total_s": t3 - t0, "import_s": t1 - t0, "load_s": t2 - t1, "peak": status("VmHWM")}}))
"""


def _llama_child(site: str, gguf: str, tokens: int, threads: int) -> dict:
    return json.loads(run_child(LLAMA_CHILD.format(site=site, gguf=gguf, tokens=tokens, threads=threads)))


def _child(model: str, mode: str, tokens: int, bare: bool = False) -> dict:
    root = str(Path(__file__).resolve().parent.parent)
    code = CHILD.format(root=root, model=model, mode=mode, tokens=tokens, bare=bare)
    return json.loads(run_child(code, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}))


def _weights_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model folder (default: the default model's conversion)")
    parser.add_argument("--modes", nargs="+", default=["none", "int8", "int4"])
    parser.add_argument("--repeats", type=int, default=3, help="later loads (mapped) per mode")
    parser.add_argument("--tokens", type=int, default=512, help="tokens of the one forward")
    parser.add_argument("--llama-site", help="site-packages folder holding llama_cpp (omit: kvsnap only)")
    args = parser.parse_args(argv)

    from kvsnap.models import catalog, resolve_model

    folder = Path(args.model) if args.model else resolve_model(catalog.DEFAULT_MODEL)
    model = str(folder)
    rows: list[dict] = []
    bare = [_child(model, "none", args.tokens, bare=True)["total_s"] for _ in range(args.repeats)]
    for mode in args.modes:
        if mode != "none":
            for form in catalog.quantized_forms(folder):
                if f"-{mode}-" in form.name:  # this mode's only: the others' are measured already
                    form.unlink()
        first = _child(model, mode, args.tokens)
        later = [_child(model, mode, args.tokens) for _ in range(args.repeats)]
        forms = [p for p in catalog.quantized_forms(folder) if f"-{mode}-" in p.name] if mode != "none" else []
        kept = sum(p.stat().st_size for p in forms)
        for label, runs in (("first", [first]), ("later", later)):
            if mode == "none" and label == "first":
                continue
            rows.append(
                {
                    "mode": mode if mode == "none" else runs[0]["quantization"],
                    "load": label if mode != "none" else "-",
                    "mapped": all(r["mapped"] for r in runs),
                    "total_s": statistics.median(r["total_s"] for r in runs),
                    "over_torch_s": statistics.median(r["total_s"] for r in runs) - statistics.median(bare),
                    "load_s": statistics.median(r["load_s"] for r in runs),
                    "peak_mb": statistics.median(r["peak"] for r in runs) / 1e6,
                    "kept_mb": kept / 1e6 if mode != "none" else None,
                    "runs": runs,
                }
            )
        if mode == "none":
            rows[-1:] = [{**rows[-1], "runs": [first, *later]}]
    source = catalog.marker(folder).get("source")
    if args.llama_site and isinstance(source, str) and Path(source).is_file():
        import torch

        runs = [
            _llama_child(args.llama_site, source, args.tokens, torch.get_num_threads()) for _ in range(args.repeats)
        ]
        rows.append(
            {
                "mode": "llama.cpp",
                "load": "-",
                "mapped": True,
                "total_s": statistics.median(r["total_s"] for r in runs),
                "over_torch_s": statistics.median(r["total_s"] - r["import_s"] for r in runs),
                "load_s": statistics.median(r["load_s"] for r in runs),
                "peak_mb": statistics.median(r["peak"] for r in runs) / 1e6,
                "kept_mb": None,
                "runs": runs,
            }
        )
    info = machine()
    print(describe(info))
    print(f"model: {model}; weight files {_weights_bytes(folder) / 1e6:.1f} MB", end="")
    if isinstance(source, str) and Path(source).is_file():
        print(f"; its GGUF {Path(source).stat().st_size / 1e6:.1f} MB")
    else:
        print()
    print(f"bare `import torch`: {statistics.median(bare):.2f} s (median of {len(bare)})")
    columns = [
        ("mode", "weights", "s"),
        ("load", "load", "s"),
        ("mapped", "mapped", ""),
        ("total_s", "to first forward s", ".2f"),
        ("over_torch_s", "minus import torch", ".2f"),
        ("load_s", "load_model s", ".2f"),
        ("peak_mb", "peak RSS MB", ".0f"),
        ("kept_mb", "kept form MB", ".1f"),
    ]
    print(table(rows, columns))
    gguf = Path(source).stat().st_size if isinstance(source, str) and Path(source).is_file() else None
    write_json(
        "quantized_load",
        {"machine": info, "model": model, "weights_bytes": _weights_bytes(folder), "gguf_bytes": gguf,
         "bare_import_torch_s": bare, "tokens": args.tokens, "rows": rows},
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
