"""A multi-turn chat workload through `kvsnap run --batch --store`: tokens reused vs the oracle.

Three conversations of four turns share one system prompt; each job is the conversation so far
(scripted earlier answers, so every prompt extends the previous one) and asks for a short answer.
The oracle is the best any prefix cache could do: the longest common token prefix of each
prompt with any earlier prompt (and that floored to whole blocks, what a block store can hold).

    .venv/bin/python benchmarks/store_chat.py [--block-size 64] [--budget 200MB]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import table, write_json  # noqa: E402
from kvsnap.models import load_tokenizer, resolve_model  # noqa: E402
from kvsnap.prefix import common_prefix_len  # noqa: E402

SYSTEM = (
    "You are the reference desk of the Meridian Line Railway museum. Answer briefly and precisely. "
    "The railway opened in 1887 between the harbour town of Calder and the mining city of Brannock, "
    "212 kilometres inland. Its chief engineer, Elsa Varga, designed the Hollow Gap viaduct, whose eleven "
    "stone arches still carry trains. The line was electrified in 1961 and carries four million passengers "
    "a year. The museum is open Tuesday to Sunday, 10:00 to 17:00; entry is free for children under 12."
)
CONVERSATIONS = [
    [
        ("Who designed the viaduct?", "Elsa Varga, the chief engineer."),
        ("How many arches does it have?", "Eleven stone arches."),
        ("Do trains still use it?", "Yes, trains still cross it today."),
        ("When was the line electrified?", "In 1961."),
    ],
    [
        ("When is the museum open?", "Tuesday to Sunday, 10:00 to 17:00."),
        ("Is it open on Mondays?", "No, it is closed on Mondays."),
        ("What does entry cost for a child of 8?", "Nothing: entry is free under 12."),
        ("And for a child of 14?", "The standard ticket price applies."),
    ],
    [
        ("How long is the line?", "212 kilometres."),
        ("Which towns does it join?", "Calder on the coast and Brannock inland."),
        ("How many passengers use it?", "About four million a year."),
        ("When did it open?", "In 1887."),
    ],
]


def jobs() -> list[dict]:
    out = []
    for c, turns in enumerate(CONVERSATIONS):
        messages = [{"role": "system", "content": SYSTEM}]
        for t, (question, answer) in enumerate(turns):
            messages.append({"role": "user", "content": question})
            out.append({"id": f"c{c}t{t}", "messages": list(messages), "max_new_tokens": 8, "temperature": 0})
            messages.append({"role": "assistant", "content": answer})
    # Interleave the conversations, as a server would see them.
    return [out[t * 1 + c * 4] for t in range(4) for c in range(3)]


def prompt_ids(tokenizer, batch: list[dict]) -> list[list[int]]:
    """Each job's prompt as token ids, rendered through the model's chat template as `kvsnap run` renders it."""
    out = []
    for job in batch:
        text = tokenizer.apply_chat_template(job["messages"], tokenize=False, add_generation_prompt=True)
        out.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out


def oracle(prompts: list[list[int]], i: int) -> int:
    """The most any prefix cache could reuse of prompt ``i``: its longest common prefix with an earlier one."""
    return max((common_prefix_len(prompts[i], p) for p in prompts[:i]), default=0)


def run_batch(
    batch: list[dict], model: str, block_size: int, store: Path, budget: str | None = None
) -> tuple[list[dict], float]:
    """The jobs through `kvsnap run --batch --store` in a process of its own: one result per job, and
    the wall time."""
    jobs_file = store.parent / "jobs.jsonl"
    jobs_file.write_text("\n".join(json.dumps(j) for j in batch) + "\n")
    cmd = [sys.executable, "-m", "kvsnap_cli.main", "run", "--model", model, "--batch", str(jobs_file)]
    cmd += ["--store", str(store), "--block-size", str(block_size)]
    if budget:
        cmd += ["--store-budget", budget]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(proc.stderr)
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()], seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--budget", default=None)
    args = parser.parse_args()
    batch = jobs()
    prompts = prompt_ids(load_tokenizer(resolve_model(args.model)), batch)
    with tempfile.TemporaryDirectory() as tmp:
        results, seconds = run_batch(batch, args.model, args.block_size, Path(tmp) / "store", args.budget)

    rows = []
    bs = args.block_size
    for i, (job, ids, res) in enumerate(zip(batch, prompts, results)):
        best = oracle(prompts, i)
        assert res["prompt_tokens"] == len(ids), (res["prompt_tokens"], len(ids))
        rows.append(
            {
                "job": job["id"],
                "prompt_tokens": len(ids),
                "reused": res["hit_tokens"],
                "oracle": best,
                "block_oracle": best // bs * bs,
                "ttft_s": res["ttft_s"],
            }
        )
    total = {k: sum(r[k] for r in rows) for k in ("prompt_tokens", "reused", "oracle", "block_oracle")}
    rows.append({"job": "total", **total, "ttft_s": sum(r["ttft_s"] for r in rows)})
    cols = [
        ("job", "job", "s"),
        ("prompt_tokens", "prompt", "d"),
        ("reused", "reused", "d"),
        ("oracle", "oracle", "d"),
        ("block_oracle", "oracle, whole blocks", "d"),
        ("ttft_s", "ttft s", ".3f"),
    ]
    print(f"{len(batch)} chat jobs through `kvsnap run --batch --store`, blocks of {bs}, {seconds:.1f} s in all")
    print(table(rows, cols))
    share = total["reused"] / total["oracle"] if total["oracle"] else 0.0
    block_share = total["reused"] / total["block_oracle"] if total["block_oracle"] else 0.0
    print(
        f"reused {total['reused']} of {total['prompt_tokens']} prompt tokens; "
        f"{share:.1%} of the oracle, {block_share:.1%} of the whole-block oracle"
    )
    write_json(
        "store_chat", {"block_size": bs, "rows": rows, "reused_vs_oracle": share, "vs_block_oracle": block_share}
    )


if __name__ == "__main__":
    main()
