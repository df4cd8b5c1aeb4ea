"""Shared helpers for the benchmark scripts: deterministic prompts, timing, table + JSON output."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"

_WORDS = [
    "the",
    "river",
    "city",
    "market",
    "north",
    "winter",
    "light",
    "paper",
    "engine",
    "garden",
    "silver",
    "account",
    "history",
    "window",
    "mountain",
    "letter",
    "harbor",
    "machine",
    "question",
    "evening",
    "village",
    "system",
    "library",
    "station",
    "travel",
    "answer",
    "kingdom",
    "summer",
    "figure",
    "number",
    "island",
    "forest",
    "bridge",
    "measure",
    "signal",
    "doctor",
    "theory",
    "reason",
    "voice",
    "ancient",
    "modern",
    "quiet",
    "golden",
    "narrow",
    "distant",
    "simple",
    "careful",
    "sudden",
    "bright",
    "heavy",
    "gentle",
]


def document(tokenizer, num_tokens: int, seed: int = 0) -> list[int]:
    """Token ids of exactly ``num_tokens`` tokens of deterministic pseudo-prose."""
    rng = random.Random(seed)
    parts: list[str] = []
    words = 0
    ids: list[int] = []
    while len(ids) < num_tokens:
        # Tokenize once per batch of sentences, not per sentence: linear in the length, so a 16k
        # prompt costs as little as a short one.
        while words < max(num_tokens, len(ids) + 64):
            sentence = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 16)))
            parts.append(sentence.capitalize() + ".")
            words += sentence.count(" ") + 1
        ids = list(tokenizer(" ".join(parts))["input_ids"])
        words = len(ids)
    return ids[:num_tokens]


def model_arguments(parser, *, codec: bool = False) -> None:
    """The options of a benchmark that loads a model and times several runs of it."""
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    if codec:
        parser.add_argument("--codec", default="shuffle-zstd", help="codec of the snapshots (raw: no decompression)")


def best_of(n: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    """Smallest wall time of ``n`` runs (and the last result): noise only ever adds time."""
    times, result = [], None
    for _ in range(n):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), result


def best_of_each(n: int, fns: dict[str, Callable[[], Any]]) -> dict[str, tuple[float, Any]]:
    """``best_of`` for several functions whose runs alternate, so that a slow spell of a shared
    machine falls on all of them alike; returns name -> (smallest time, every run's result)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    results: dict[str, list[Any]] = {name: [] for name in fns}
    for _ in range(n):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            results[name].append(fn())
            times[name].append(time.perf_counter() - t0)
    return {name: (min(times[name]), results[name]) for name in fns}


def run_child(code: str, env: dict[str, str] | None = None) -> str:
    """Run ``python -c code`` in a new process; returns its last stdout line, or raises with its stderr."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"child process failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout.strip().splitlines()[-1]


MEMORY_CHILD = """
import json, sys, time
sys.path.insert(0, {root!r})
import torch, kvsnap.models.native, kvsnap.models.quantize  # imported before the first reading: not weights
from kvsnap.models import load_model
from kvsnap.models.quantize import weight_bytes

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

before, t0 = status("VmRSS"), time.perf_counter()
lm = load_model({model!r}, **{options!r})
seconds = time.perf_counter() - t0
with torch.inference_mode():  # a forward reads every weight: a mapped float file is resident only then
    lm.model(torch.tensor([[1, 2, 3, 4]]))
print(json.dumps({{"rss": status("VmRSS") - before, "peak": status("VmHWM") - before, "load_s": seconds,
                  "tensors": weight_bytes(lm.model)}}))
"""


def weights_memory(model: str, quantize: str, dtype: str | None = None) -> dict[str, float]:
    """What ``model``'s weights cost on the CPU, measured in a fresh process so nothing else loaded
    counts: "rss" (resident bytes they add), "peak" (the most resident while loading), "load_s" and
    "tensors" (bytes the weight tensors hold). ``dtype`` None: the loader's default."""
    options: dict[str, str] = {"device": "cpu", "quantize": quantize}
    if dtype is not None:
        options["dtype"] = dtype
    root = str(Path(__file__).resolve().parent.parent)
    return json.loads(run_child(MEMORY_CHILD.format(root=root, model=model, options=options)))


def kept(session, method: str, *args):
    """Call ``session.method(*args)`` and return the session: a timed run that returns what it
    built is not charged for freeing it (the baselines keep theirs too)."""
    getattr(session, method)(*args)
    return session


def synced(device, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` followed by a wait for the GPU, so a timing covers the work it queued."""
    import torch

    def run():
        result = fn()
        if getattr(device, "type", device) == "cuda":
            torch.cuda.synchronize()
        return result

    return run


def median(values: list[float]) -> float:
    return statistics.median(values)


def machine() -> dict[str, Any]:
    import torch
    import transformers

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
    }
    cpu = _cpu_model()
    if cpu:
        info["cpu_model"] = cpu
    with contextlib.suppress(ValueError, OSError, AttributeError):  # sysconf names are POSIX-only
        info["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def describe(info: dict[str, Any]) -> str:
    """One line naming the machine, for the top of a table."""
    parts = [f"{info.get('cpu_model') or info['processor']}, {info['cpu_count']} cores"]
    if "memory_gib" in info:
        parts.append(f"{info['memory_gib']:.0f} GiB")
    if "gpu" in info:
        parts.append(info["gpu"])
    parts.append(f"torch {info['torch']}, transformers {info['transformers']}")
    return "machine: " + ", ".join(parts)


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """Render rows as a plain-text table; columns are (key, header, format)."""
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        cells.append([format(row[k], f) if row.get(k) is not None else "-" for k, _, f in columns])
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["  ".join(c[i].rjust(widths[i]) for i in range(len(columns))) for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(name: str, payload: dict[str, Any]) -> Path:
    # KVSNAP_BENCH_RESULTS: somewhere else (the tests' smoke runs must not replace real results).
    folder = Path(os.environ.get("KVSNAP_BENCH_RESULTS") or RESULTS)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path
