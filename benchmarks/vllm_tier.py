"""kvsnap's block store as vLLM's KV tier: time to first token of a fresh engine with and without it.

Three engines, one after another, each in a process of its own (benchmarks/vllm_engine.py), each
answering one prompt per length with one token (so a request's wall time is its time to first
token), after a short warm-up request:
- ``cold + save``: an engine with the connector and an empty store computes every prompt and saves it;
- ``from store``: a fresh engine with the connector on that store answers the same prompts plus a
  question (its hit covers the prompts' whole blocks, the rest is prefilled);
- ``no store``: a fresh engine without the connector answers those.
The prompts share no prefix, so vLLM's own prefix cache never serves one from another. Then, in
this process, the store's read and write rates on the saved blocks: fetch + decode + copy into a
paged cache of vLLM's CPU layout, and gather + encode + put into a new store (GB/s of raw KV), and
the decoding alone.
One run of each: engine starts take minutes on a busy small machine.

With ``--chat``, instead: the hit ratio on store_chat.py's 12 interleaved chat requests (three
conversations of four turns, one system prompt), replayed through one vLLM engine with the connector
and vLLM's own prefix cache off, so every token it reuses came from the store, beside kvsnap's own
(``kvsnap run --batch --store``, as store_chat.py runs it) on the same token ids, both with blocks of
``--block-size`` tokens.

    .venv-vllm/bin/python benchmarks/vllm_tier.py [--lengths 1024 4096 8100] [--model FOLDER]
    .venv-vllm/bin/python benchmarks/vllm_tier.py --chat [--block-size 64]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "integration_vllm"))

from benchmarks.common import describe, machine, table, write_json  # noqa: E402

QUESTION = "\nQ: What is this text about?\nA:"


def documents(model: Path, lengths: list[int]) -> list[list[int]]:
    """One token list per length, of pseudo-prose that starts differently every time."""
    from vllm_engines import tokenize

    words = (ROOT / "examples" / "report.txt").read_text().split()
    out = []
    for seed, n in enumerate(lengths):
        rng = random.Random(seed)
        ids: list[int] = []
        while len(ids) < n:
            ids += tokenize(model, " " + " ".join(rng.choice(words) for _ in range(n)))
        out.append(ids[:n])
    return out


def run_engine(name: str, model: Path, store: Path | None, prompts: list[list[int]], folder: Path, max_len: int):
    from vllm_engines import Engine

    warm = [{"ids": list(range(1000, 1100)), "max_tokens": 1}]  # first-request costs out of the figures
    job = {
        "model": str(model),
        "store": str(store) if store else None,
        "requests": warm + [{"ids": p, "max_tokens": 1} for p in prompts],
        "in_process": True,
        "max_model_len": max_len,
        "kv_cache_bytes": 3 << 30,
    }
    engine = Engine(job, folder, name)
    records = engine.finish()
    print(f"{name}: engine up in {records[0]['ready']:.0f} s", file=sys.stderr)
    return records[2:]  # the ready line and the warm-up


def store_rates(store_dir: Path, prompts: list[list[int]]) -> list[dict[str, float]]:
    """Per prompt: GB/s of raw KV read (fetch + decode + copy into paged caches) and written
    (gather + encode + put into a new store), as the connector's worker does them."""
    import numpy as np
    import torch

    from kvsnap.hashing import chain_hashes
    from kvsnap.integrations import vllm_pages as pages
    from kvsnap.store import BlockStore

    store = BlockStore(store_dir, create=False)
    (chain,) = store.read_index().chains.values()
    bs, layout = chain.block_size, chain.layout
    rates = []
    for ids in prompts:
        n = len(ids) // bs
        shape = (n, layout.num_kv_heads, bs, 2 * layout.head_dim)
        caches = [torch.zeros(shape, dtype=pages.DTYPES[layout.dtype]) for _ in range(layout.num_layers)]
        t0 = time.perf_counter()
        _, blocks = store.fetch(ids, chain.root, bs)
        for i, b in enumerate(blocks):
            raw = b.decode(layout.itemsize, out=np.empty(b.record.raw_bytes, dtype=np.uint8))
            pages.scatter(caches, [i], pages.decoded(raw, layout, bs))
        read_s = time.perf_counter() - t0
        raw_bytes = sum(b.record.raw_bytes for b in blocks)
        t0 = time.perf_counter()  # the codec alone, for scale: most of a read on a small CPU
        for b in blocks:
            b.decode(layout.itemsize, out=np.empty(b.record.raw_bytes, dtype=np.uint8))
        decode_s = time.perf_counter() - t0
        with tempfile.TemporaryDirectory() as tmp:
            fresh = BlockStore(tmp)
            tokens = ids[: len(blocks) * bs]
            t0 = time.perf_counter()
            hashes = chain_hashes(tokens, bs, chain.root)
            encoded = [pages.encode(pages.gather(caches, [i]), h, "shuffle-zstd", 1) for i, h in enumerate(hashes)]
            fresh.put(chain, tokens, encoded, codec="shuffle-zstd", made_by=blocks[0].record.made_by)
            write_s = time.perf_counter() - t0
        seconds = {"read_gbps": read_s, "decode_gbps": decode_s, "write_gbps": write_s}
        rates.append({k: raw_bytes / v / 1e9 for k, v in seconds.items()} | {"raw_mb": raw_bytes / 1e6})
    return rates


def chat_hits(model: Path, folder: Path, block_size: int) -> list[dict]:
    """store_chat.py's requests through kvsnap and through vLLM with the connector: per request, its
    prompt tokens, the whole-block oracle, and the tokens each reused from its store."""
    from vllm_engines import Engine

    from benchmarks import store_chat
    from kvsnap.models import load_tokenizer
    from kvsnap.store import BlockStore

    batch = store_chat.jobs()
    prompts = store_chat.prompt_ids(load_tokenizer(model), batch)
    ours, _ = store_chat.run_batch(batch, str(model), block_size, folder / "kvsnap-store")
    job = {
        "model": str(model),
        "store": str(folder / "vllm-store"),
        "requests": [{"ids": ids, "max_tokens": j["max_new_tokens"]} for ids, j in zip(prompts, batch)],
        "in_process": True,
        "block_size": block_size,  # vLLM's, and so the store's: its CPU kernel takes multiples of 32
        "prefix_caching": False,
    }
    records = Engine(job, folder, "chat").finish()[1:]
    stats = BlockStore(folder / "vllm-store", create=False).stats()
    print(f"vLLM's store: {stats['blocks']} blocks, {stats['hit_tokens']} tokens read by loads", file=sys.stderr)
    rows = []
    for i, (j, ids, mine, theirs) in enumerate(zip(batch, prompts, ours, records)):
        assert mine["prompt_tokens"] == theirs["prompt_tokens"] == len(ids)
        best = store_chat.oracle(prompts, i)
        rows.append(
            {
                "job": j["id"],
                "prompt_tokens": len(ids),
                "block_oracle": best // block_size * block_size,
                "kvsnap_reused": mine["hit_tokens"],
                "vllm_loaded": theirs["num_cached_tokens"],
            }
        )
    return rows


def chat_main(model: Path, block_size: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        rows = chat_hits(model, Path(tmp), block_size)
    total = {k: sum(r[k] for r in rows) for k in rows[0] if k != "job"}
    ratios = {k: v / total["prompt_tokens"] for k, v in total.items() if k != "prompt_tokens"}
    info = machine()
    import vllm

    info["vllm"] = vllm.__version__
    print(describe(info) + f", vLLM {vllm.__version__}, blocks of {block_size} tokens")
    columns = [
        ("job", "job", "s"),
        ("prompt_tokens", "prompt", "d"),
        ("block_oracle", "oracle, whole blocks", "d"),
        ("kvsnap_reused", "kvsnap reused", "d"),
        ("vllm_loaded", "vLLM loaded from store", "d"),
    ]
    print(table([*rows, {"job": "total", **total}], columns))
    print(", ".join(f"{k} {v:.1%}" for k, v in ratios.items()) + " of the prompt tokens")
    path = write_json("vllm_tier_chat", {"machine": info, "rows": rows, "block_size": block_size, "ratios": ratios})
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8100])
    parser.add_argument("--model", type=Path, help="a model folder (default: kvsnap's default model)")
    parser.add_argument("--chat", action="store_true", help="the hit ratio on store_chat.py's requests instead")
    parser.add_argument("--block-size", type=int, default=64, help="with --chat: tokens a block holds")
    args = parser.parse_args()
    from vllm_engines import default_model, tokenize

    model = args.model or default_model()
    if args.chat:
        chat_main(model, args.block_size)
        return
    docs = documents(model, args.lengths)
    asked = [d + tokenize(model, QUESTION) for d in docs]
    max_len = max(len(a) for a in asked) + 8
    with tempfile.TemporaryDirectory() as tmp:
        folder, store = Path(tmp), Path(tmp) / "store"
        cold = run_engine("cold + save", model, store, docs, folder, max_len)
        warm = run_engine("from store", model, store, asked, folder, max_len)
        none = run_engine("no store", model, None, asked, folder, max_len)
        rates = store_rates(store, docs)
        rows = []
        for n, c, w, x, r in zip(args.lengths, cold, warm, none, rates):
            assert w["token_ids"] == x["token_ids"], "the store changed an answer"
            rows.append(
                {
                    "prompt_tokens": w["prompt_tokens"],
                    "ttft_no_store_s": x["seconds"],
                    "ttft_from_store_s": w["seconds"],
                    "speedup": x["seconds"] / w["seconds"],
                    "ttft_cold_save_s": c["seconds"],
                    "loaded_tokens": w["num_cached_tokens"],
                    **r,
                    "length": n,
                }
            )
    info = machine()
    import vllm

    info["vllm"] = vllm.__version__
    print(describe(info) + f", vLLM {vllm.__version__}")
    columns = [
        ("prompt_tokens", "prompt", "d"),
        ("loaded_tokens", "loaded", "d"),
        ("ttft_no_store_s", "TTFT no store s", ".2f"),
        ("ttft_from_store_s", "from store s", ".2f"),
        ("speedup", "speedup", ".1f"),
        ("ttft_cold_save_s", "cold + save s", ".2f"),
        ("raw_mb", "KV MB", ".0f"),
        ("read_gbps", "store read GB/s", ".2f"),
        ("decode_gbps", "of which decode GB/s", ".2f"),
        ("write_gbps", "store write GB/s", ".2f"),
    ]
    print(table(rows, columns))
    path = write_json("vllm_tier", {"machine": info, "rows": rows, "dtype": "float32", "threads": 1})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
