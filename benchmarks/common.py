"""Shared helpers for the benchmark scripts: deterministic prompts, timing, table + JSON output."""

from __future__ import annotations

import json
import platform
import random
import statistics
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
    parts = []
    ids: list[int] = []
    while len(ids) < num_tokens:
        sentence = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 16)))
        parts.append(sentence.capitalize() + ".")
        ids = list(tokenizer(" ".join(parts))["input_ids"])
    return ids[:num_tokens]


def best_of(n: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    """Smallest wall time of ``n`` runs (and the last result): noise only ever adds time."""
    times, result = [], None
    for _ in range(n):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), result


def median(values: list[float]) -> float:
    return statistics.median(values)


def machine() -> dict[str, Any]:
    import os

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
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


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
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path
