"""A two-turn chat through the Python API: answer, save, resume in a fresh session, answer again.

.venv/bin/python examples/chat_api.py [--model smollm2-135m] [--out chat.kv]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import kvsnap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=kvsnap.DEFAULT_MODEL)
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "kvsnap-chat.kv")
    args = parser.parse_args()

    lm = kvsnap.load_model(args.model, install=True)
    greedy = kvsnap.SamplingParams(max_new_tokens=48, temperature=0)

    first = kvsnap.Session(lm)
    print("> What is the capital of France?")
    result = first.chat("What is the capital of France?", greedy, on_text=lambda t: print(t, end="", flush=True))
    print(f"\n   [{result.prefill_tokens} tokens prefilled]")
    saved = first.save(args.out)
    print(f"saved {saved.tokens} tokens to {args.out}")

    # A new session (as in a new process): restore the whole conversation, then continue it.
    second = kvsnap.Session(lm)
    restored = second.restore(args.out)
    print(f"resumed {restored.hit_tokens} tokens in {restored.seconds:.3f} s ({len(second.messages)} messages)")
    print("> And of Italy?")
    result = second.chat("And of Italy?", greedy, on_text=lambda t: print(t, end="", flush=True))
    print(f"\n   [{result.prompt_tokens} prompt tokens, {result.hit_tokens} reused, {result.prefill_tokens} prefilled]")


if __name__ == "__main__":
    main()
