"""Autosave off the chat's critical path, at ~1k, ~2k and ~4k tokens of chat history: the time from the
end of an answer to the next prompt when the chat saves in line (before) and when it saves in a background
thread (now), and the background save's own duration.

What is timed is what ``kvsnap chat`` does between an answer and its next prompt: the autosave's conflict
check, then the whole save (before: the answer's last sampled token run through the model, then the file
written) or only its start (now: a thread started; that token is left to the next turn). Each repeat is
one more short turn, then the two ways in turn, so a slow spell of a shared machine falls on both alike;
the figures are the smallest of the repeats.

    .venv/bin/python benchmarks/autosave.py [--history 1024 2048 4096] [--repeats 3] [--answer 16]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import describe, document, machine, median, table, write_json  # noqa: E402
from kvsnap.config import SamplingParams  # noqa: E402
from kvsnap.engine.background_save import BackgroundSaver  # noqa: E402
from kvsnap.engine.session import Session  # noqa: E402
from kvsnap.format.save_target import AutosaveTarget  # noqa: E402
from kvsnap.models import load_model  # noqa: E402

TARGET_S = 0.05  # the prompt is back this soon after an answer at 4k tokens of history


def inline(session: Session, target: AutosaveTarget) -> tuple[float, float]:
    """Before: the chat saved (running the answer's last sampled token through the model first), then
    prompted. Returns (seconds from the answer to the prompt, of which that forward pass)."""
    t0 = time.perf_counter()
    assert target.conflict(session.all_tokens, session.messages) is None
    session.flush()
    flushed = time.perf_counter() - t0
    session.save(target.path)
    target.saved(session.tokens, session.messages)
    return time.perf_counter() - t0, flushed


def background(session: Session, target: AutosaveTarget) -> tuple[float, float]:
    """Now: the chat starts the save and prompts. Returns (seconds to the prompt, the save's own seconds)."""
    saver = BackgroundSaver(session)
    t0 = time.perf_counter()
    assert target.conflict(session.all_tokens, session.messages) is None
    saver.start(target.path)
    prompt_back = time.perf_counter() - t0
    saved = saver.wait()  # the next turn waits for it (here at once: no one is typing)
    target.saved(saved.held.tokens, saved.held.messages, stamp=saved.stamp)
    return prompt_back, saved.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--history", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--answer", type=int, default=16, help="tokens each timed turn answers")
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    lm = load_model(args.model)
    params = SamplingParams(max_new_tokens=args.answer, temperature=0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.history:
            text = lm.tokenizer.decode(document(lm.tokenizer, n, seed=n))
            session = Session(lm)
            session.messages = [
                {"role": "user", "content": f"Read this and answer my questions.\n\n{text}"},
                {"role": "assistant", "content": "I have read it. Ask away."},
            ]
            target = AutosaveTarget(Path(tmp) / f"chat{n}.kv")
            session.chat("What is it about?", params)  # prefills the history
            inline(session, target)  # the first save encodes every block: not the per-turn cost
            times: dict[str, list[float]] = {"inline": [], "inline_forward": [], "background": [], "save": []}
            for r in range(args.repeats):
                session.chat(f"Tell me more, part {2 * r + 1}.", params)
                total, forward = inline(session, target)
                times["inline"].append(total)
                times["inline_forward"].append(forward)
                session.chat(f"Tell me more, part {2 * r + 2}.", params)
                prompt_back, save_s = background(session, target)
                times["background"].append(prompt_back)
                times["save"].append(save_s)
            rows.append(
                {
                    "history": session.num_tokens,
                    "inline_prompt_s": min(times["inline"]),
                    "inline_forward_s": min(times["inline_forward"]),
                    "background_prompt_s": min(times["background"]),
                    "background_save_s": min(times["save"]),
                    "background_save_median_s": median(times["save"]),
                    "file_mb": target.path.stat().st_size / 1e6,
                    "runs": times,
                }
            )
    cols = [
        ("history", "history tokens", ","),
        ("inline_prompt_s", "answer->prompt, save in line s", ".3f"),
        ("inline_forward_s", "(of which last-token forward s)", ".3f"),
        ("background_prompt_s", "answer->prompt, background s", ".4f"),
        ("background_save_s", "background save s", ".3f"),
        ("file_mb", "file MB", ".1f"),
    ]
    info = machine()
    print(describe(info))
    print(f"autosave after a turn ({args.answer}-token answers), {args.model}, {lm.device}, {lm.layout.dtype}")
    print(f"best of {args.repeats} per column; target: the prompt back within {TARGET_S} s at 4k tokens")
    print(table(rows, cols))
    payload = {"machine": info, "model": args.model, "answer": args.answer, "repeats": args.repeats, "rows": rows}
    print(f"wrote {write_json('autosave', payload)}")


if __name__ == "__main__":
    main()
