"""Weight quantization (``--quantize``) against float weights: memory, speed and agreement, per setting.

For each setting (``none``, ``int8``, ``int4``, each with ``float32`` and ``bfloat16`` activations where
asked), on one model:
- weights' resident memory: a new process's RSS after ``load_model`` and one short forward (which reads
  every weight: a float folder is mapped, resident once read) minus its RSS just before the load, and
  the peak (VmHWM) minus the same, next to the GGUF file's size when the model is one;
- decode tokens/s after a ``--context``-token document (greedy, ``--new-tokens``, median of ``--repeats``);
- cold prefill seconds of that document (best of ``--repeats``);
- greedy-token agreement with float32 weights and activations: over ``--prompts`` prompts, float32's own
  greedy continuation is fed to the setting (teacher forcing), and the share of positions where the
  setting's top token is float32's is counted; the first position where they part is the first one
  where free-running greedy output would differ;
- perplexity of a fixed text (examples/report.txt) in ``--window``-token windows.

    .venv/bin/python benchmarks/quantize.py                     # the default model, every setting
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import best_of, describe, document, machine, table, weights_memory, write_json  # noqa: E402
from kvsnap.config import DEFAULT_MODEL, SamplingParams  # noqa: E402
from kvsnap.engine.session import Session  # noqa: E402
from kvsnap.models import load_model, resolve_model  # noqa: E402

TEXT = Path(__file__).resolve().parent.parent / "examples" / "report.txt"
SETTINGS = [f"{q}-{d}" for q in ("none", "int8", "int4") for d in ("float32", "bfloat16")]


def gguf_bytes(model: str) -> int | None:
    from kvsnap.models import catalog

    source = catalog.marker(resolve_model(model)).get("source")
    return Path(source).stat().st_size if isinstance(source, str) and Path(source).is_file() else None


def decode_rate(lm, ids: list[int], new_tokens: int) -> float:
    session = Session(lm)
    session.prefill(ids)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, stop_loops=False)
    t0 = time.perf_counter()
    made = session.generate(params).token_ids
    return (len(made) - 1) / (time.perf_counter() - t0)  # the first token came from the prefill


def prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens: stretches of the fixed text, else seeded pseudo-prose."""
    ids = tokenizer(TEXT.read_text(), add_special_tokens=False)["input_ids"]
    stride = max(1, (len(ids) - length) // count)
    found = [ids[i * stride : i * stride + length] for i in range(count) if i * stride + length <= len(ids)]
    return found + [document(tokenizer, length, seed=i) for i in range(count - len(found))]


def logits(lm, ids: list[int]):
    import torch

    from kvsnap.engine.cache import cache_for

    # Over a cache, as every forward kvsnap runs (a quantized model on kvsnap's kernel needs one).
    with torch.inference_mode():
        return lm.model(torch.tensor([ids]), cache=cache_for(lm)).logits[0].float()  # [len(ids), vocab]


def continuations(lm, starts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, stop_loops=False)
    out = []
    for ids in starts:
        session = Session(lm)
        session.prefill(ids)
        out.append(list(session.generate(params).token_ids))
    return out


def agreement(lm, starts: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """(share of positions whose top token is the reference's, mean first position where they part)."""
    same = total = 0
    firsts = []
    for ids, ref in zip(starts, reference):
        top = logits(lm, ids + ref[:-1])[len(ids) - 1 :].argmax(-1).tolist()  # [len(ref)]
        hits = [a == b for a, b in zip(top, ref)]
        same, total = same + sum(hits), total + len(hits)
        firsts.append(hits.index(False) if False in hits else len(hits))
    return same / total, statistics.mean(firsts)


def perplexity(lm, window: int) -> float:
    import torch
    import torch.nn.functional as F

    ids = lm.tokenizer(TEXT.read_text(), add_special_tokens=False)["input_ids"]
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        piece = ids[start : start + window]
        if len(piece) < 2:
            break
        out = logits(lm, piece)
        nll += float(F.cross_entropy(out[:-1], torch.tensor(piece[1:]), reduction="sum"))
        count += len(piece) - 1
    return math.exp(nll / count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=SETTINGS)
    parser.add_argument("--context", type=int, default=512, help="tokens before the decode, and prefilled cold")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--agree-tokens", type=int, default=32, help="greedy tokens compared per prompt")
    parser.add_argument("--window", type=int, default=512, help="perplexity window in tokens")
    args = parser.parse_args()

    resolve_model(args.model, install=True)
    file_bytes = gguf_bytes(args.model)
    reference = load_model(args.model, device="cpu", dtype="float32", quantize="none")
    starts = prompts(reference.tokenizer, args.prompts, args.prompt_tokens)
    wanted = continuations(reference, starts, args.agree_tokens)
    doc = document(reference.tokenizer, args.context)
    rows = []
    for setting in args.settings:
        quantize, dtype = setting.split("-")
        same = setting == "none-float32"
        lm = reference if same else load_model(args.model, device="cpu", dtype=dtype, quantize=quantize)
        decode_rate(lm, doc[:32], 4)  # warm up
        rates = [decode_rate(lm, doc, args.new_tokens) for _ in range(args.repeats)]
        prefill_s, _ = best_of(args.repeats, lambda lm=lm: Session(lm).prefill(doc))
        share, first = agreement(lm, starts, wanted)
        mem = weights_memory(args.model, quantize, dtype)
        row = {
            "setting": setting,
            "quantization": lm.quantization,
            "weights_rss_mb": mem["rss"] / 1e6,
            "weights_peak_mb": mem["peak"] / 1e6,
            "tensor_mb": mem["tensors"] / 1e6,
            "rss_over_gguf": mem["rss"] / file_bytes if file_bytes else None,
            "decode_tok_s": statistics.median(rates),
            "prefill_s": prefill_s,
            "agreement": share,
            "first_difference": first,
            "perplexity": perplexity(lm, args.window),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)  # a slow machine shows each setting as it ends
        if lm is not reference:
            del lm
    base = next((r["perplexity"] for r in rows if r["setting"] == "none-float32"), None)
    for row in rows:
        row["ppl_over_float32"] = row["perplexity"] / base if base else None

    info = machine()
    print(describe(info))
    gguf = f"GGUF file {file_bytes / 1e6:.1f} MB; " if file_bytes else ""
    print(
        f"{args.model}: {gguf}decode after {args.context} tokens ({args.new_tokens} greedy, median of {args.repeats}), "
        f"cold prefill of {args.context} (best of {args.repeats}); agreement with float32 over {len(starts)} prompts "
        f"x {args.agree_tokens} tokens; perplexity of {TEXT.name} in {args.window}-token windows"
    )
    columns = [
        ("setting", "setting", "s"),
        ("weights_rss_mb", "weights RSS MB", ".0f"),
        ("weights_peak_mb", "load peak MB", ".0f"),
        ("tensor_mb", "tensors MB", ".0f"),
        ("decode_tok_s", "decode tok/s", ".1f"),
        ("prefill_s", "prefill s", ".2f"),
        ("agreement", "top-1 agree", ".3f"),
        ("first_difference", "first diff", ".1f"),
        ("perplexity", "ppl", ".2f"),
        ("ppl_over_float32", "ppl / f32", ".3f"),
    ]
    if file_bytes:
        columns.insert(2, ("rss_over_gguf", "RSS / GGUF", ".2f"))
    print(table(rows, columns))
    payload = {"machine": info, "model": args.model, "gguf_bytes": file_bytes, "args": vars(args), "rows": rows}
    print(f"wrote {write_json('quantize', payload)}")


if __name__ == "__main__":
    main()
