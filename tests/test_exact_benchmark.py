"""benchmarks/exact.py runs end to end on a tiny model and its figures hang together (not a timing test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.bench


def test_exact_benchmark_times_both_forwards_and_checks_the_kv(tiny_model_dir, kvsnap_home, tmp_path):
    env = {**os.environ, "KVSNAP_HOME": str(kvsnap_home), "KVSNAP_BENCH_RESULTS": str(tmp_path)}
    args = ["--model", str(tiny_model_dir("llama")), "--lengths", "40", "130", "--repeats", "1", "--check"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "exact.py"), *args, "--decode-steps", "2", "--chunk", "64"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.startswith("machine: ")
    data = json.loads((tmp_path / "exact.json").read_text())
    assert [(r["dtype"], r["tokens"]) for r in data["rows"]] == [
        ("float32", 40),
        ("float32", 130),
        ("bfloat16", 40),
        ("bfloat16", 130),
    ]
    for row in data["rows"]:
        for key in ("plain_prefill_s", "exact_prefill_s", "plain_decode_s", "exact_decode_s"):
            assert row[key] > 0, key
        assert row["prefill_ratio"] == pytest.approx(row["exact_prefill_s"] / row["plain_prefill_s"])
        assert row["exact_invariant"] is True  # the KV of chunks of 97 is the KV of chunks of 64
