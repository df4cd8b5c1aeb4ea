"""What ``--verify`` costs: a resume's time to first token without and with the check, the check's own
time (``verify_s``), which blocks it recomputed, and a cold prefill of the same prompt, per document length.

    .venv/bin/python benchmarks/verify.py [--lengths 512 1850] [--repeats 3] [--model smollm2-135m]

The check recomputes the first restored block, the last and one drawn between them, each at every layer,
plus two one-token forwards per block: its cost follows the block size, not the document's length (apart
from the attention over the prefix and one copy of the restored KV).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import describe, document, machine, median, model_arguments, table, write_json  # noqa: E402
from kvsnap.config import SamplingParams  # noqa: E402
from kvsnap.engine.session import Session  # noqa: E402
from kvsnap.models import load_model  # noqa: E402

QUESTION = 16  # tokens after the document: the prompt leaves the snapshot, so no stored logits are used
ONE = SamplingParams(max_new_tokens=1, temperature=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1850])
    parser.add_argument("--block-size", type=int, default=64)
    model_arguments(parser)
    args = parser.parse_args()
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.lengths:
            ids = document(lm.tokenizer, n + QUESTION, seed=n)
            path = Path(tmp) / f"doc{n}.kv"
            primer = Session(lm, block_size=args.block_size)
            primer.prefill(ids[:n])
            primer.save(path)
            runs: dict[str, list] = {"resume": [], "verified": [], "cold": []}
            for _ in range(args.repeats):  # alternating, so a slow spell of a shared machine hits all alike
                runs["resume"].append(Session(lm, block_size=args.block_size, verify=False).run(ids, ONE, resume=path))
                runs["verified"].append(Session(lm, block_size=args.block_size, verify=True).run(ids, ONE, resume=path))
                runs["cold"].append(Session(lm, block_size=args.block_size).run(ids, ONE))
            for result in runs["resume"] + runs["verified"]:
                assert result.hit_tokens == n and result.restore_error is None, "the resume reused the document"
            checked = runs["verified"][-1].verify
            assert all(r.verify["passed"] for r in runs["verified"]), "sound KV passes its check"
            rows.append(
                {
                    "tokens": n + QUESTION,
                    "resume_ttft_s": median([r.ttft_s for r in runs["resume"]]),
                    "verified_ttft_s": median([r.ttft_s for r in runs["verified"]]),
                    "verify_s": median([r.verify_s for r in runs["verified"]]),
                    "cold_ttft_s": median([r.ttft_s for r in runs["cold"]]),
                    "blocks_checked": len(checked["blocks"]),
                    "check_tokens": checked["tokens"],
                    "blocks": checked["blocks"],
                    "max_abs_diff": max(r.verify_max_abs_diff for r in runs["verified"]),
                }
            )
    cols = [
        ("tokens", "prompt tokens", "d"),
        ("resume_ttft_s", "resume TTFT s", ".3f"),
        ("verified_ttft_s", "resume --verify TTFT s", ".3f"),
        ("verify_s", "verify_s", ".3f"),
        ("cold_ttft_s", "cold TTFT s", ".3f"),
        ("blocks_checked", "blocks checked", "d"),
        ("check_tokens", "tokens run by the check", "d"),
        ("max_abs_diff", "K/V max |diff|", ".2g"),
    ]
    info = machine()
    print(describe(info))
    print(f"--verify, {args.model}, {lm.device}, {lm.layout.dtype}, {args.block_size}-token blocks, "
          f"median of {args.repeats}")  # fmt: skip
    print(table(rows, cols))
    payload = {"machine": info, "model": args.model, "block_size": args.block_size, "rows": rows}
    print(f"wrote {write_json('verify', payload)}")


if __name__ == "__main__":
    main()
