"""How much of the previous turn a sampled chat reuses: the ids it ran, appended to, against rendering
the whole conversation again and matching it.

Each seed is one chat of ``--turns`` turns in memory (`Session.chat`, as `kvsnap chat` runs it), sampled at
``--temperature``. For every turn after the first: the previous turn's tokens (its prompt and the answer as
sampled, the last sampled token included although it has no KV yet), the tokens this turn reused, and what
matching a fresh rendering of the conversation would have reused (the longest common prefix, of the tokens
with KV).

    .venv/bin/python benchmarks/chat_reuse.py [--turns 20] [--seeds 5] [--temperature 0.7] [--max-new-tokens 48]

On a busy machine the seeds can run as processes of their own (``--first-seed K --seeds 1``, each with its
own ``KVSNAP_BENCH_RESULTS``), and ``--combine A.json B.json ...`` prints their table together.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import describe, machine, table, write_json  # noqa: E402
from kvsnap.config import SamplingParams  # noqa: E402
from kvsnap.engine.session import Session  # noqa: E402
from kvsnap.models import load_model  # noqa: E402
from kvsnap.prefix import common_prefix_len  # noqa: E402

SYSTEM = "You are a helpful assistant. Answer in a few sentences."
QUESTIONS = [
    "What is the capital of France?",
    "Tell me something about its history.",
    "Which river runs through it?",
    "Name a famous museum there.",
    "What can I eat there?",
    "How do I get there from London?",
    "Is it expensive to stay there?",
    "What is the weather like in spring?",
    "Suggest a day trip from the city.",
    "What language do people speak?",
    "Give me three useful phrases.",
    "What is a good gift to bring home?",
    "Which neighbourhood is best for walking?",
    "Are there parks in the city?",
    "What is the metro like?",
    "Recommend a book about the city.",
    "What happens there in July?",
    "How old is the cathedral?",
    "What should I avoid as a tourist?",
    "Summarise our conversation in one line.",
]


def one_chat(session: Session, turns: int, params: SamplingParams, seed: int) -> dict:
    session.reset()
    held = reused = kv = rerender = 0
    lowest = 1.0
    differed = 0
    for t in range(turns):
        question = QUESTIONS[t % len(QUESTIONS)]
        before = session.all_tokens
        computed = len(session.tokens)
        if t:
            view = [*(session.view_messages or []), {"role": "user", "content": question}]
            # A rendering can reuse only tokens with KV: the answer's last sampled token has none yet.
            matched = min(common_prefix_len(before, session.render_chat(view)), computed)
        result = session.chat(question, dataclasses.replace(params, seed=seed * 1000 + t), system=SYSTEM)
        if not t:
            continue
        held += len(before)
        kv += computed
        reused += result.hit_tokens
        rerender += matched
        differed += matched < computed
        lowest = min(lowest, result.hit_tokens / len(before))
    return {
        "seed": seed,
        "turns": turns,
        "final_tokens": session.num_tokens,
        "previous_tokens": held,
        "reused_tokens": reused,
        "kv_tokens": kv,
        "reused_share": round(reused / held, 5),
        "share_of_kv": round(reused / kv, 5),
        "lowest_turn_share": round(lowest, 5),
        "rerender_tokens": rerender,
        "rerender_share": round(rerender / held, 5),
        "rerender_broke_turns": differed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--combine", nargs="+", type=Path, metavar="JSON", help="print these runs' seeds as one table")
    args = parser.parse_args()
    if args.combine:
        runs = [json.loads(path.read_text()) for path in args.combine]
        info = next((run["machine"] for run in runs if "machine" in run), None) or machine()
        given = {**vars(args), "combine": [str(path) for path in args.combine]}
        report([r for run in runs for r in run["rows"] if r["seed"] != "all"], info, given, 0.0)
        return
    lm = load_model(args.model)
    session = Session(lm)
    rows = []
    t0 = time.perf_counter()
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=seed)
        rows.append(one_chat(session, args.turns, params, seed))
        print(f"seed {seed}: {rows[-1]['reused_share']:.2%} reused", flush=True)
        write_json(
            "chat_reuse", {"machine": machine(), "args": vars(args), "rows": rows, "complete": False}
        )  # a long run keeps its seeds
    report(rows, machine(), vars(args), round(time.perf_counter() - t0, 1))


def report(rows: list[dict], info: dict, args: dict, seconds: float) -> None:
    total = {k: sum(r[k] for r in rows) for k in ("previous_tokens", "kv_tokens", "reused_tokens", "rerender_tokens")}
    rows.append(
        {
            "seed": "all",
            "turns": sum(r["turns"] for r in rows),
            "final_tokens": sum(r["final_tokens"] for r in rows),
            **total,
            "reused_share": round(total["reused_tokens"] / total["previous_tokens"], 5),
            "share_of_kv": round(total["reused_tokens"] / total["kv_tokens"], 5),
            "lowest_turn_share": min(r["lowest_turn_share"] for r in rows),
            "rerender_share": round(total["rerender_tokens"] / total["previous_tokens"], 5),
            "rerender_broke_turns": sum(r["rerender_broke_turns"] for r in rows),
        }
    )
    print(describe(info))
    cols = [
        ("seed", "seed", ""),
        ("turns", "turns", "d"),
        ("final_tokens", "tokens at the end", ","),
        ("reused_share", "reused of previous turn", ".2%"),
        ("share_of_kv", "of it with KV", ".2%"),
        ("lowest_turn_share", "lowest turn", ".2%"),
        ("rerender_share", "re-render would reuse", ".2%"),
        ("rerender_broke_turns", "turns re-render breaks", "d"),
    ]
    print(table(rows, cols))
    write_json("chat_reuse", {"machine": info, "args": args, "rows": rows, "seconds": seconds, "complete": True})


if __name__ == "__main__":
    main()
