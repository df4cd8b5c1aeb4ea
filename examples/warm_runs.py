"""A script that asks many questions with `kvsnap run`, each a new process, through a warm process.

Each `kvsnap run` would spend seconds importing torch; after `kvsnap warm start` each one is handed
to an already-imported process and starts at once. The script primes the document once, asks its
questions (each resumes the primed snapshot), prints how long each process took from start to exit,
and stops the warm process if it started it.

.venv/bin/python examples/warm_runs.py [--model smollm2-135m] [--out doc.kv]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DOCUMENT = (
    "The Meridian Line Railway opened in 1887 between the harbour town of Calder and the mining "
    "city of Brannock, 212 kilometres inland. Its chief engineer, Elsa Varga, designed the "
    "Hollow Gap viaduct, whose eleven stone arches still carry trains today. "
) * 6
QUESTIONS = ["Who was the chief engineer?", "How long is the line?", "When did it open?"]


def kvsnap(*args: str, stdin: str | None = None) -> str:
    """`kvsnap ARGS` (this Python's), its stdout; exits on a failure with kvsnap's own message."""
    proc = subprocess.run([sys.executable, "-m", "cli.main", *args], input=stdin, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"kvsnap {' '.join(args[:2])} failed: {proc.stderr.strip()}")
    return proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "kvsnap-warm-doc.kv")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()

    started = json.loads(kvsnap("warm", "start", "--model", args.model, "--json"))
    print(f"warm process {started['pid']}: {'already up' if started['already'] else 'started'}")
    try:
        doc = args.out.with_suffix(".txt")
        doc.write_text(DOCUMENT)
        # Raw prompts: a chat template (--chat) would import transformers in each run (~1.5 s more).
        run = ("run", "--model", args.model, "--prompt-file", str(doc))
        kvsnap(*run, "--max-new-tokens", "0", "--save", str(args.out))
        for question in QUESTIONS:
            begin = time.perf_counter()
            ask = ("--prompt", f"\nQ: {question}\nA:", "--resume", str(args.out), "--stop", "\n")
            row = json.loads(kvsnap(*run, *ask, "--max-new-tokens", str(args.max_new_tokens), "--json"))
            took = time.perf_counter() - begin
            print(f"Q: {question}\nA: {row['text'].strip()}")
            print(
                f"   [{row['prompt_tokens']} prompt tokens, {row['hit_tokens']} reused, "
                f"{row['prefill_tokens']} prefilled, {row['new_tokens']} new; the whole `kvsnap run` process: "
                f"{took:.2f} s, its first token after {row['ttft_s']:.2f} s of model time]"
            )
        served = [p for p in json.loads(kvsnap("warm", "status", "--json"))["processes"] if p["current"]]
        print(f"the warm process served {served[0]['served'] if served else 0} runs")
    finally:
        if not started["already"]:  # one the user had running is left as it was
            kvsnap("warm", "stop", "--pid", str(started["pid"]))


if __name__ == "__main__":
    main()
