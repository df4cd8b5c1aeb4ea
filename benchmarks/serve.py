"""Chat traffic through `kvsnap serve` across a restart, block store on and off: TTFT and cached tokens.

The workload is store_chat's: three conversations of four turns, one shared system prompt,
interleaved as a server sees them (scripted earlier answers, so every prompt extends the one
before). Each request streams through the official `openai` client; TTFT is measured there, to
the first piece of text, after a short warm-up request at each start. Half way (after every
conversation's second turn) the server is killed with SIGKILL and started again. With the store,
the later turns still find their conversation's prefix on disk; without it the cache died with
the process. Even before the restart, only the last conversation is in memory: interleaved
conversations find their own history only in the store.

    .venv/bin/python benchmarks/serve.py [--model smollm2-135m] [--block-size 64] [--max-tokens 16]
        [--document-tokens 1024]   # a long document in the system prompt: prefills that matter
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import describe, machine, table, write_json  # noqa: E402
from benchmarks.store_chat import CONVERSATIONS, SYSTEM  # noqa: E402

RESTART_AFTER_TURN = 1  # turns 0 and 1 of every conversation, then the restart, then turns 2 and 3


def requests(system: str = SYSTEM) -> list[tuple[str, int, list[dict]]]:
    """(job id, turn, messages) of every request, interleaved by turn."""
    out = []
    for turn in range(4):
        for c, turns in enumerate(CONVERSATIONS):
            messages = [{"role": "system", "content": system}]
            for question, answer in turns[:turn]:
                messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            messages.append({"role": "user", "content": turns[turn][0]})
            out.append((f"c{c}t{turn}", turn, messages))
    return out


class Server:
    def __init__(self, args: argparse.Namespace, store: Path | None, log: Path):
        self.log = log
        cmd = [sys.executable, "-m", "kvsnap_cli.main", "serve", "--model", args.model, "--port", "0"]
        cmd += ["--device", args.device, "--dtype", args.dtype, "--block-size", str(args.block_size)]
        cmd += ["--store", str(store)] if store is not None else ["--no-store"]
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + 600  # the first start may convert the default model
        while (found := re.search(r"http://127\.0\.0\.1:(\d+)/v1", log.read_text())) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                sys.exit(f"the server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        import openai

        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{found.group(1)}/v1", api_key="-", max_retries=0)
        # The first forward of a process pages the weights in (seconds for a 500 MB model): one short
        # request first, so TTFT measures prefill and reuse, not the page-in, with the store and without.
        self.ask([{"role": "user", "content": "Hello"}], 1)

    def ask(self, messages: list[dict], max_tokens: int) -> tuple[float, int, int]:
        """(TTFT seconds, prompt tokens, cached tokens) of one streamed greedy answer."""
        t0 = time.perf_counter()
        first, usage = None, None
        stream = self.client.chat.completions.create(
            model="default",
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - t0
            if chunk.usage is not None:
                usage = chunk.usage
        assert usage is not None, "the server sent no usage"
        ttft = first if first is not None else time.perf_counter() - t0  # an empty answer: the whole request
        return ttft, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def system_prompt(args: argparse.Namespace) -> str:
    """store_chat's system prompt, with ``--document-tokens`` of pseudo-prose after it (a document
    the whole conversation is about: what makes a prefill long enough to matter)."""
    if not args.document_tokens:
        return SYSTEM
    from benchmarks.common import document
    from kvsnap.models import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(args.model, install=True))
    text = tokenizer.decode(document(tokenizer, args.document_tokens))
    return f"{SYSTEM}\n\nThe museum's guide book:\n{text}"


def replay(args: argparse.Namespace, tmp: Path, with_store: bool) -> list[dict]:
    store = tmp / "store" if with_store else None
    name = "on" if with_store else "off"
    server = Server(args, store, tmp / f"{name}-1.log")
    rows = []
    try:
        for job, turn, messages in requests(args.system):
            if turn == RESTART_AFTER_TURN + 1 and job.startswith("c0"):
                server.kill()  # SIGKILL: no shutdown work at all
                server = Server(args, store, tmp / f"{name}-2.log")
            try:
                ttft, prompt, hit = server.ask(messages, args.max_tokens)
            except Exception as exc:
                sys.exit(f"{job} failed: {exc}\n{server.log.read_text()[-3000:]}")
            rows.append(
                {
                    "job": job,
                    "after_restart": turn > RESTART_AFTER_TURN,
                    "prompt": prompt,
                    "cached": hit,
                    "ttft_s": ttft,
                }
            )
    finally:
        server.kill()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--document-tokens", type=int, default=0, help="pseudo-prose after the system prompt")
    args = parser.parse_args()
    try:
        import openai  # noqa: F401
    except ImportError:
        sys.exit("this benchmark talks to the server with the openai package: pip install -e '.[dev]'")
    info = machine()
    args.system = system_prompt(args)
    with tempfile.TemporaryDirectory() as tmp:
        on = replay(args, Path(tmp), with_store=True)
        off = replay(args, Path(tmp), with_store=False)
    rows = []
    for a, b in zip(on, off):
        assert a["prompt"] == b["prompt"], (a, b)
        rows.append(
            {
                "job": a["job"] + (" *" if a["after_restart"] else ""),
                "prompt": a["prompt"],
                "cached_on": a["cached"],
                "ttft_on_s": a["ttft_s"],
                "cached_off": b["cached"],
                "ttft_off_s": b["ttft_s"],
            }
        )
    totals = {}
    for key, part in (
        ("before", [r for r in on if not r["after_restart"]]),
        ("after", [r for r in on if r["after_restart"]]),
    ):
        jobs = {r["job"] for r in part}
        off_part = [r for r in off if r["job"] in jobs]
        totals[key] = {
            "prompt": sum(r["prompt"] for r in part),
            "cached_on": sum(r["cached"] for r in part),
            "cached_off": sum(r["cached"] for r in off_part),
            "ttft_on_s": sum(r["ttft_s"] for r in part) / len(part),
            "ttft_off_s": sum(r["ttft_s"] for r in off_part) / len(off_part),
        }
    cols = [
        ("job", "job", "s"),
        ("prompt", "prompt", "d"),
        ("cached_on", "cached (store)", "d"),
        ("ttft_on_s", "ttft s (store)", ".3f"),
        ("cached_off", "cached (no store)", "d"),
        ("ttft_off_s", "ttft s (no store)", ".3f"),
    ]
    print(describe(info))
    print(
        f"{len(rows)} streamed chat requests through `kvsnap serve` ({args.model}, blocks of {args.block_size}); "
        "* = after the server was killed and restarted"
    )
    print(table(rows, cols))
    for key, t in totals.items():
        print(
            f"{key} the restart: {t['cached_on']} of {t['prompt']} prompt tokens cached with the store, "
            f"{t['cached_off']} without; mean ttft {t['ttft_on_s']:.3f} s vs {t['ttft_off_s']:.3f} s"
        )
    write_json(
        "serve",
        {
            "machine": info,
            "model": args.model,
            "block_size": args.block_size,
            "max_tokens": args.max_tokens,
            "document_tokens": args.document_tokens,
            "rows": rows,
            "store_on": on,
            "store_off": off,
            "totals": totals,
        },
    )


if __name__ == "__main__":
    main()
