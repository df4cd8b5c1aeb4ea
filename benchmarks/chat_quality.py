"""Does the default chat answer plain questions? Factual questions x seeds x sampling settings, scored
by whether the answer names the expected fact, and how answers ended (EOS, loop stopped, limit).

    .venv/bin/python benchmarks/chat_quality.py [--seeds 20] [--max-new-tokens 64]

Each question is a fresh one-turn chat with the model's chat template, as `kvsnap chat` sends it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import describe, machine, table, write_json  # noqa: E402
from kvsnap.config import SamplingParams  # noqa: E402
from kvsnap.engine.session import Session  # noqa: E402
from kvsnap.models import load_model  # noqa: E402

QUESTIONS = [
    ("What is the capital of France?", ("paris",)),
    ("What is the capital of Italy?", ("rome",)),
    ("What is the capital of Japan?", ("tokyo",)),
    ("Which planet is the largest in our solar system?", ("jupiter",)),
    ("Who wrote Romeo and Juliet?", ("shakespeare",)),
]
SETTINGS = {
    "t0.7 p0.95 (old default)": dict(temperature=0.7, top_p=0.95),
    "t0.2 p0.9": dict(temperature=0.2, top_p=0.9),
    "greedy": dict(temperature=0.0),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS))
    args = parser.parse_args()
    lm = load_model(args.model)
    session = Session(lm)
    rows, samples = [], []
    for name in args.settings:
        seeds = [0] if SETTINGS[name].get("temperature") == 0 else range(args.seeds)
        right = total = loops = limit = 0
        t0 = time.perf_counter()
        for question, expected in QUESTIONS:
            for seed in seeds:
                session.reset()
                params = SamplingParams(max_new_tokens=args.max_new_tokens, seed=seed, **SETTINGS[name])
                result = session.chat(question, params)
                ok = any(word in result.text.lower() for word in expected)
                right += ok
                total += 1
                loops += result.stop_reason == "repetition"
                limit += result.stop_reason == "length"
                if seed == 0:
                    samples.append({"setting": name, "question": question, "answer": result.text, "correct": ok})
        rows.append(
            {
                "setting": name,
                "answers": total,
                "correct": round(right / total, 3),
                "loop_stopped": loops,
                "hit_limit": limit,
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )
        print(f"{name}: {rows[-1]['correct']:.0%} of {total} correct", flush=True)
    info = machine()
    print(describe(info))
    cols = [
        ("setting", "sampling", "s"),
        ("answers", "answers", "d"),
        ("correct", "correct", ".0%"),
        ("loop_stopped", "loops stopped", "d"),
        ("hit_limit", "hit the limit", "d"),
    ]
    print(table(rows, cols))
    write_json("chat_quality", {"machine": info, "args": vars(args), "rows": rows, "samples": samples})


if __name__ == "__main__":
    main()
