"""What a new `kvsnap run` process spends before its first token, stage by stage: resumed and cold.

For each prompt length a snapshot holds the prompt minus a 32-token suffix. Each repeat runs, each
in a new process and alternating, `kvsnap run --prompt-file P --resume S --reuse load
--max-new-tokens 1 --json` and the same run cold (no --resume); with --trees, once per source tree
(a `git worktree` of another commit), so a change is measured side by side in one run, on one
machine state. The CLI states its stages when KVSNAP_TIMINGS=1 (cli/startup.py stamps, the model
load's own steps in LoadedModel.load_timings); a tree without that hook shows its totals and what
`run --json` reports. Each cell: median (min-max) of the repeats, in seconds; "cpu" is the child's
user+sys time, which a busy machine inflates less than the wall time.

    .venv/bin/python benchmarks/startup.py                       # 512 2048 4096 tokens, 3 repeats
    .venv/bin/python benchmarks/startup.py --trees /tmp/base .   # before (a worktree) and after
    .venv/bin/python benchmarks/startup.py --backends native transformers   # KVSNAP_NATIVE=1 vs 0

Imports in detail: `python -X importtime -m kvsnap_cli.main run ...` (transformers loads some of its
modules past the import system, so their time shows under whoever asked for them).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import describe, document, machine, model_arguments, table, write_json  # noqa: E402

SUFFIX = 32
# The console script `kvsnap`, run from a given source tree.
# The tree's cli/ folder is the package kvsnap_cli (pyproject's package-dir); a tree that predates
# that name imports it as `cli`.
_BOOT = """import importlib.util as u, os, sys
t = os.environ["PYTHONPATH"].split(os.pathsep)[0]
if "kvsnap_cli" in open(os.path.join(t, "cli", "main.py")).read():
    s = u.spec_from_file_location("kvsnap_cli", os.path.join(t, "cli", "__init__.py"),
                                  submodule_search_locations=[os.path.join(t, "cli")])
    sys.modules["kvsnap_cli"] = m = u.module_from_spec(s)
    s.loader.exec_module(m)
    from kvsnap_cli.main import main
else:
    from cli.main import main
sys.argv[0] = "kvsnap"
sys.exit(main())"""

# (stage, what it covers); the rows of each table, in the order a process meets them.
STAGES = [
    ("interpreter", "exec to the CLI's first import (python, site)"),
    ("cli imports", "the entry point (kvsnap_cli.main)"),
    ("command line", "the app's imports (typer, rich, the command modules), then typer parses"),
    ("before load", "settings checks; an older tree imports torch/transformers here"),
    ("load: resolve", "model name to folder"),
    ("load: torch", "import torch"),
    ("load: kvsnap.engine", "kvsnap's cache adapter and the native model module"),
    ("load: transformers", "import transformers (top level); native: not imported"),
    ("load: config", "config.json read (native) or AutoConfig with its imports"),
    ("load: attention", "transformers only: kvsnap_sdpa registered, imports modeling_utils"),
    ("load: model class", "transformers only: the modeling module of the model type"),
    ("load: weights", "native: safetensors mapped; transformers: from_pretrained"),
    ("load: place", "model.to(device)"),
    ("load: tokenizer", "native: tokenizer.json on `tokenizers`; else transformers' class"),
    ("load: fingerprint", "config, tokenizer, weights digests"),
    ("load: other", "the rest of the load (spinner, garbage collector freeze)"),
    ("session", "Session built, reuse cost model read"),
    ("restore", "snapshot read, checked, decoded into the KV buffer"),
    ("prefill", "the suffix (resumed) or the whole prompt (cold)"),
    ("first token", "decode of the first new token"),
    ("request other", "prompt read and tokenized, bookkeeping"),
    ("exit", "JSON printed, interpreter shutdown"),
    ("= model loaded", "exec to the model loaded (wall)"),
    ("= answered", "exec to the first token printed (wall)"),
    ("total", "exec to exit (wall)"),
    ("cpu", "user+sys of the whole process"),
]
_LOAD_KEYS = {
    "load: resolve": "resolve",
    "load: torch": "torch",
    "load: kvsnap.engine": "kvsnap.engine",
    "load: transformers": "transformers",
    "load: config": "config",
    "load: attention": "attention",
    "load: model class": "model_class",
    "load: weights": "weights",
    "load: place": "place",
    "load: tokenizer": "tokenizer",
    "load: fingerprint": "fingerprint",
}


def prepare(args, folder: Path) -> list[tuple[int, Path, Path]]:
    """Per length: (tokens, prompt text file, snapshot of the prompt minus its suffix)."""
    from kvsnap.engine.session import Session
    from kvsnap.models import load_model

    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    made = []
    for n in args.lengths:
        ids = document(lm.tokenizer, n)
        text = folder / f"prompt-{n}.txt"
        text.write_text(lm.tokenizer.decode(ids))
        snap = folder / f"prefix-{n}.kv"
        session = Session(lm)
        session.prefill(ids[:-SUFFIX])
        session.save(snap)
        made.append((n, text, snap))
    return made


def run_env(tree: Path, backend: str | None) -> dict[str, str]:
    """The environment of every run from ``tree``.

    ``backend`` "native" or "transformers" sets KVSNAP_NATIVE (kvsnap.models.native) for the run."""
    env = {**os.environ, "PYTHONPATH": str(tree), "KVSNAP_TIMINGS": "1"}
    if backend is not None:
        env["KVSNAP_NATIVE"] = "1" if backend == "native" else "0"
    return env


def run_once(tree: Path, args, text: Path, snap: Path | None, env: dict[str, str]) -> dict[str, Any]:
    """One `kvsnap run` in a new process from ``tree``: its JSON row, wall time and CPU time."""
    cmd = [sys.executable, "-c", _BOOT, "run", "--prompt-file", str(text), "--max-new-tokens", "1", "--json"]
    cmd += ["--model", args.model, "--device", args.device, "--dtype", args.dtype]
    if snap is not None:
        cmd += ["--resume", str(snap), "--reuse", "load"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    spawn = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
    end = time.time()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{tree}: kvsnap run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    if snap is not None and not row.get("hit_tokens"):
        raise RuntimeError(f"{tree}: the resume reused nothing ({row.get('restore_error')})")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"row": row, "spawn": spawn, "end": end, "cpu": cpu}


def stages(run: dict[str, Any]) -> dict[str, float]:
    """A run's seconds per stage (``STAGES``); stages its tree does not report are left out."""
    row, spawn, end = run["row"], run["spawn"], run["end"]
    out = {"total": end - spawn, "cpu": run["cpu"]}
    for key, name in (("restore_s", "restore"), ("prefill_s", "prefill"), ("decode_s", "first token")):
        if row.get(key) is not None:
            out[name] = row[key]
    timings = row.get("timings")
    if not timings:
        return out
    s, load = timings["stamps"], timings.get("load", {})
    marks = [("interpreter", spawn, "cli"), ("cli imports", "cli", "main"), ("command line", "main", "command")]
    marks += [("before load", "command", "load"), ("session", "loaded", "session"), ("exit", "done", end)]
    for name, a, b in marks:
        a = s.get(a) if isinstance(a, str) else a
        b = s.get(b) if isinstance(b, str) else b
        if a is not None and b is not None:
            out[name] = b - a
    if "loaded" in s:
        out["= model loaded"] = s["loaded"] - spawn
    if "done" in s:
        out["= answered"] = s["done"] - spawn
    for stage, key in _LOAD_KEYS.items():
        if key in load:
            out[stage] = load[key]
    if "load" in s and "loaded" in s:
        out["load: other"] = s["loaded"] - s["load"] - sum(load.values())
    if "session" in s and "done" in s and row.get("ttft_s") is not None:
        out["request other"] = s["done"] - s["session"] - row["ttft_s"]
    return out


def summarize(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096])
    parser.add_argument(
        "--trees", type=Path, nargs="+", default=[ROOT], help="source trees to run `kvsnap` from (default: this one)"
    )
    parser.add_argument(
        "--backends",
        nargs="+",
        choices=["native", "transformers"],
        help="run each tree once per model backend (KVSNAP_NATIVE=1 / 0), side by side",
    )
    model_arguments(parser)
    args = parser.parse_args()
    tree_paths = [t.resolve() for t in args.trees]
    names = [t.name or str(t) for t in tree_paths]
    if len(set(names)) != len(names):
        names = [str(t) for t in tree_paths]
    # (label, tree, backend): one column pair per tree, or per tree and backend.
    variants = [(n, t, None) for n, t in zip(names, tree_paths)]
    if args.backends:
        both = len(names) > 1
        variants = [(f"{n} {b}" if both else b, t, b) for n, t in zip(names, tree_paths) for b in args.backends]
    labels = [v[0] for v in variants]
    modes = ("resume", "cold")
    columns = [(label, mode) for label in labels for mode in modes]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        made = prepare(args, Path(tmp))
        envs = {label: run_env(tree, backend) for label, tree, backend in variants}
        for r in range(args.repeats):
            for n, text, snap in made:
                for label, tree, _ in variants:
                    for mode in modes:
                        run = run_once(tree, args, text, snap if mode == "resume" else None, envs[label])
                        runs.append({"tokens": n, "tree": label, "mode": mode, "repeat": r, **run})
            print(f"  repeat {r + 1}/{args.repeats} done", file=sys.stderr)

    summary: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for n in args.lengths:
        summary[str(n)] = {}
        for label, mode in columns:
            per_stage: dict[str, list[float]] = {}
            for run in runs:
                if (run["tokens"], run["tree"], run["mode"]) == (n, label, mode):
                    for stage, seconds in stages(run).items():
                        per_stage.setdefault(stage, []).append(seconds)
            summary[str(n)][f"{label} {mode}"] = {stage: summarize(v) for stage, v in per_stage.items()}

    info = machine()
    print(describe(info))
    print(
        f"model {args.model} ({args.device}, {args.dtype}), `kvsnap run --max-new-tokens 1` in a new process, "
        f"resumed from a snapshot of all but {SUFFIX} tokens, or cold; median (min-max) of {args.repeats}, seconds"
    )
    width = max(len(stage) for stage, _ in STAGES)
    for stage, what in STAGES:
        print(f"  {stage:<{width}}  {what}")
    for n in args.lengths:
        print(f"\n{n} prompt tokens")
        rows = []
        for stage, what in STAGES:
            row: dict[str, Any] = {"stage": stage, "what": what}
            for label, mode in columns:
                cell = summary[str(n)][f"{label} {mode}"].get(stage)
                row[f"{label} {mode}"] = (
                    f"{cell['median']:.3f} ({cell['min']:.2f}-{cell['max']:.2f})" if cell is not None else None
                )
            rows.append(row)
        cols = [("stage", "stage", "s")] + [(f"{lb} {m}", f"{lb} {m}", "s") for lb, m in columns]
        print(table(rows, cols))
    payload = {
        "machine": info,
        "model": args.model,
        "device": args.device,
        "dtype": args.dtype,
        "suffix": SUFFIX,
        "lengths": args.lengths,
        "trees": {label: str(tree) for label, tree, _ in variants},
        "backends": {label: backend for label, _, backend in variants},
        "stages": dict(STAGES),
        "summary": summary,
        "runs": [
            {k: v for k, v in run.items() if k != "row"} | {"stages": stages(run), "timings": run["row"].get("timings")}
            for run in runs
        ],
    }
    path = write_json("startup", payload)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
