"""Plot the resume benchmark (results/resume.json) as benchmarks/resume.png.

.venv/bin/pip install 'kvsnap[bench]'   # matplotlib
.venv/bin/python benchmarks/plot.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("matplotlib is needed: .venv/bin/pip install 'kvsnap[bench]'")
    data = json.loads((HERE / "results" / "resume.json").read_text())
    rows = data["rows"]
    tokens = [r["tokens"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(tokens, [r["cold_ttft_s"] for r in rows], "o-", label="cold prefill")
    left.plot(tokens, [r["resumed_ttft_s"] for r in rows], "o-", label="resumed (.kv prefix + 32-token suffix)")
    left.plot(tokens, [r["restore_s"] for r in rows], "o--", label="restore only (read + decode + cache)")
    left.plot(tokens, [r["st_load_s"] for r in rows], "o:", label="uncompressed safetensors read")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("prompt tokens")
    left.set_ylabel("seconds")
    left.set_title("Time to first token")
    left.legend(fontsize=8)
    left.grid(True, which="both", alpha=0.3)
    right.bar([str(t) for t in tokens], [r["speedup"] for r in rows], color="tab:green")
    for i, r in enumerate(rows):
        right.text(i, r["speedup"], f"{r['speedup']:.1f}x", ha="center", va="bottom", fontsize=9)
    right.set_xlabel("prompt tokens")
    right.set_ylabel("cold TTFT / resumed TTFT")
    right.set_title("Resume speedup")
    m = data["machine"]
    fig.suptitle(
        f"kvsnap, {data['model']} ({data['dtype']}), {m['cpu_count']}-core {m['processor']}, torch {m['torch']}",
        fontsize=10,
    )
    fig.tight_layout()
    out = HERE / "resume.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
