"""Lossy KV storage (--kv-dtype, --codec int8-zstd): size against raw and llama.cpp, and its cost in quality.

A 2k-token document is saved losslessly and with each narrower storage dtype. Each snapshot is
restored and the same 32-token question plus the 128 tokens the lossless resume generated
(greedy) are run through it in one forward (teacher forcing): greedy agreement is the share of
those 128 positions whose argmax equals the lossless one, KL the mean KL(lossless || variant) of
the next-token distributions.

    .venv/bin/python benchmarks/lossy.py [--tokens 2048] [--new 128]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import describe, document, machine, table, write_json  # noqa: E402
from kvsnap.config import SamplingParams  # noqa: E402
from kvsnap.engine.session import Session  # noqa: E402
from kvsnap.format import Snapshot  # noqa: E402
from kvsnap.models import load_model  # noqa: E402

LLAMA_CPP_BYTES_PER_TOKEN = 23_056  # its f16 session file for this model, uncompressed
QUESTION = 32


def teacher_forced_logits(lm, snap: Path, prefix: list[int], follow: list[int]) -> torch.Tensor:
    """Logits [len(follow), vocab] after restoring ``prefix`` from ``snap`` and running ``follow``."""
    session = Session(lm)
    session.restore(snap, prefix + follow)
    assert session.tokens == prefix
    start = len(prefix)
    ids = torch.tensor([follow], device=lm.device)
    pos = torch.arange(start, start + len(follow), device=lm.device).unsqueeze(0)
    with torch.inference_mode():
        out = lm.model(input_ids=ids, position_ids=pos, use_cache=True, **{lm.cache_kwarg: session.cache})
    return out.logits[0].float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    lm = load_model(args.model)
    ids = document(lm.tokenizer, args.tokens)
    prefix, question = ids[:-QUESTION], ids[-QUESTION:]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        variants = {
            None: {},
            "float16": {"kv_dtype": "float16"},
            "bfloat16": {"kv_dtype": "bfloat16"},
            "int8 (codec int8-zstd)": {"codec": "int8-zstd"},
        }
        for name, settings in variants.items():
            session = Session(lm, **settings)
            session.prefill(prefix)
            paths[name] = Path(tmp) / f"{len(paths)}.kv"
            session.save(paths[name])
        ref_session = Session(lm)
        ref_session.run(ids, SamplingParams(max_new_tokens=args.new, temperature=0), resume=paths[None])
        follow = question + ref_session.all_tokens[len(ids) :]
        follow = follow[: QUESTION + args.new - 1]
        ref = teacher_forced_logits(lm, paths[None], prefix, follow)[QUESTION - 1 :]
        for name, path in paths.items():
            logits = teacher_forced_logits(lm, path, prefix, follow)[QUESTION - 1 :]
            agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
            kl = torch.nn.functional.kl_div(
                logits.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none"
            ).sum(-1)
            with Snapshot(path) as snap:
                kv_bytes = snap.meta.kv_bytes
            file_bytes = path.stat().st_size
            rows.append(
                {
                    "storage": name or "float32 (lossless)",
                    "file_mb": file_bytes / 1e6,
                    "vs_raw": file_bytes / kv_bytes,
                    "bytes_per_token": file_bytes / len(prefix),
                    "vs_llama_cpp": file_bytes / len(prefix) / LLAMA_CPP_BYTES_PER_TOKEN,
                    "greedy_agreement": agree,
                    "mean_kl": kl.mean().item(),
                }
            )
    cols = [
        ("storage", "KV stored as", "s"),
        ("file_mb", "file MB", ".1f"),
        ("vs_raw", "vs raw fp32", ".3f"),
        ("bytes_per_token", "bytes/token", ",.0f"),
        ("vs_llama_cpp", "vs llama.cpp", ".2f"),
        ("greedy_agreement", "greedy agreement", ".1%"),
        ("mean_kl", "mean KL", ".2e"),
    ]
    print(f"{args.model}, {len(prefix)}-token snapshot, {QUESTION}-token question, {args.new} tokens teacher-forced")
    print(table(rows, cols))
    info = machine()
    print(describe(info))
    print(f"wrote {write_json('lossy', {'machine': info, 'rows': rows})}")


if __name__ == "__main__":
    main()
