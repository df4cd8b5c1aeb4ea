"""Prime a long document once, then ask several questions over it without prefilling it again.

.venv/bin/python examples/batch_resume.py [--model smollm2-135m] [--out doc.kv]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import kvsnap

DOCUMENT = (
    "The Meridian Line Railway opened in 1887 between the harbour town of Calder and the mining "
    "city of Brannock, 212 kilometres inland. Its chief engineer, Elsa Varga, designed the "
    "Hollow Gap viaduct, whose eleven stone arches still carry trains today. The line was "
    "electrified in 1961 and now carries four million passengers a year. "
) * 6
QUESTIONS = [
    "Who was the chief engineer?",
    "How long is the line?",
    "When was it electrified?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=kvsnap.DEFAULT_MODEL)
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "kvsnap-doc.kv")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()

    lm = kvsnap.load_model(args.model, install=True)
    kvsnap.start_packing(lm)  # several forwards ahead: weights packed for oneDNN in the background (CPU)
    session = kvsnap.Session(lm)
    greedy = kvsnap.SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0)

    def prompt(question: str) -> list[int]:
        return session.render_chat([{"role": "user", "content": DOCUMENT + "\nQuestion: " + question}])

    # Prime: the part every prompt shares (the document) is prefilled once and saved.
    first, second = prompt(QUESTIONS[0]), prompt(QUESTIONS[1])
    shared = first[: next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)]
    session.run(shared, kvsnap.SamplingParams(max_new_tokens=0))
    saved = session.save(args.out)
    print(f"primed {saved.tokens} tokens into {args.out} ({saved.file_bytes:,} bytes)")

    for question in QUESTIONS:
        session.reset()
        result = session.run(prompt(question), greedy, resume=args.out)
        print(f"Q: {question}\nA: {result.text.strip()}")
        print(
            f"   [{result.prompt_tokens} prompt tokens, {result.hit_tokens} reused, "
            f"{result.prefill_tokens} prefilled, ttft {result.ttft_s:.3f} s]"
        )


if __name__ == "__main__":
    main()
