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
        from matplotlib.patches import Patch
    except ImportError:
        sys.exit("matplotlib is needed: .venv/bin/pip install 'kvsnap[bench]'")
    data = json.loads((HERE / "results" / "resume.json").read_text())
    rows = data["rows"]
    tokens = [r["tokens"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(tokens, [r["cold_ttft_s"] for r in rows], "o-", label="cold prefill")
    left.plot(tokens, [r["resumed_ttft_s"] for r in rows], "o-", label="resumed (.kv prefix + 32-token suffix)")
    if all("in_memory_ttft_s" in r for r in rows):
        left.plot(tokens, [r["in_memory_ttft_s"] for r in rows], "x-", label="suffix only (prefix already in memory)")
    # Reads as a new process pays them (`kvsnap run --resume`), when the run measured that.
    fresh = all("new_process_restore_s" in r for r in rows)
    restore_key, read_key = ("new_process_restore_s", "new_process_st_load_s") if fresh else ("restore_s", "st_load_s")
    where = ", new process" if fresh else ""
    left.plot(tokens, [r[restore_key] for r in rows], "o--", label=f"restore only (read + decode + cache{where})")
    left.plot(tokens, [r[read_key] for r in rows], "o:", label=f"uncompressed safetensors read{where}")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("prompt tokens")
    left.set_ylabel("seconds")
    left.set_title("Time to first token")
    left.legend(fontsize=8)
    left.grid(True, which="both", alpha=0.3)
    x = list(range(len(tokens)))
    fresh_ttft = all("new_process_speedup" in r for r in rows)
    width = 0.4 if fresh_ttft else 0.8
    left_x = [i - width / 2 for i in x] if fresh_ttft else x
    handles = []
    if all("ideal_speedup" in r for r in rows):
        # The ceiling: what a restore that took no time would give (cold / suffix only).
        right.bar(x, [r["ideal_speedup"] for r in rows], width=0.85, color="none", edgecolor="gray", linestyle="--")
        handles.append(Patch(facecolor="none", edgecolor="gray", linestyle="--", label="ceiling: cold / suffix only"))
        for i, r in enumerate(rows):
            right.text(i, r["ideal_speedup"], f"{r['ideal_speedup']:.1f}x", ha="center", va="bottom", fontsize=8)
    right.bar(left_x, [r["speedup"] for r in rows], width=width, color="tab:green")
    handles.append(Patch(color="tab:green", label="measured in one process"))
    for xi, r in zip(left_x, rows):
        right.text(xi, r["speedup"] / 2, f"{r['speedup']:.0f}x", ha="center", va="center", fontsize=8, color="white")
    if fresh_ttft:
        right_x = [i + width / 2 for i in x]
        right.bar(right_x, [r["new_process_speedup"] for r in rows], width=width, color="tab:olive")
        handles.append(Patch(color="tab:olive", label="each run a new process (kvsnap run)"))
        for xi, r in zip(right_x, rows):
            v = r["new_process_speedup"]
            right.text(xi, v / 2, f"{v:.0f}x", ha="center", va="center", fontsize=8, color="white")
    right.set_xticks(x, [str(t) for t in tokens])
    right.legend(handles=handles, fontsize=8, loc="upper left")
    right.set_xlabel("prompt tokens")
    right.set_ylabel("cold TTFT / resumed TTFT")
    right.set_title("Resume speedup")
    m = data["machine"]
    cpu = m.get("cpu_model") or m["processor"]
    where = m.get("gpu") or f"{m['cpu_count']}-core {cpu}"
    fig.suptitle(f"kvsnap, {data['model']} ({data['dtype']}), {where}, torch {m['torch']}", fontsize=10)
    fig.tight_layout()
    out = HERE / "resume.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
