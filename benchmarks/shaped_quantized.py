"""Llama-3.2-1B- and Llama-3-8B-shaped models with random weights, run with quantized weights on the CPU.

``build`` writes the model folder one layer at a time, in bfloat16 (one safetensors shard per layer, the
8B's 16 GB never whole in memory, nor ever in float32), with the default model's tokenizer (its ids fall
inside the larger vocabulary). ``load_model(..., quantize=...)`` then quantizes it one matrix at a time
from the mapped files. The RoPE is the plain one: the native forward does not implement Llama 3's
"llama3" frequency scaling, which changes no shape and no cost.

For each model and context length: the weights' resident memory (a new process's RSS after the load
minus before, and the load's peak), the cold prefill, the snapshot save and restore (GB/s of raw KV),
the file's size, decode tokens/s after the context; then the CLI on the same folder: ``run --save``,
``run --resume``, a ``chat`` turn and ``run --store``, each checked to reuse what the one before kept.

``--real-tokens R``: lengths over R are not prefilled. Their cache holds the KV of the longest real prefill
(at most R tokens), repeated to the length, under that length's document ids: decode, save, restore and
the file then cost what ``n`` positions cost (attention reads every position; the values' bytes are real
KV), without a prefill that would take hours on 2 cores (the 8B at 16,384 tokens). Such rows say
``filled from`` and have no prefill figure.

    .venv/bin/python benchmarks/shaped_quantized.py --shape llama-3.2-1b --lengths 4096 16384
    .venv/bin/python benchmarks/shaped_quantized.py --shape llama-3-8b --lengths 4096 16384 --real-tokens 4096
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import describe, document, machine, table, weights_memory, write_json  # noqa: E402
from benchmarks.shaped_model import SMALL_FILES  # noqa: E402

# The published configs' shapes (RoPE as said above).
SHAPES = {
    "llama-3.2-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "tie": True},
    "llama-3-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "tie": False},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "tie": False},  # smoke tests
}
COMMON = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": None,  # hidden / heads
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
}


def build(shape: str, out: Path, tokenizer_from: Path, seed: int = 0) -> Path:
    """Write the random-weight model, one decoder layer per shard, in bfloat16."""
    import torch
    from safetensors.torch import save_file

    spec = SHAPES[shape]
    h, inter, layers = spec["hidden_size"], spec["intermediate_size"], spec["num_hidden_layers"]
    heads, kv, vocab = COMMON["num_attention_heads"], COMMON["num_key_value_heads"], COMMON["vocab_size"]
    head_dim = h // heads
    source = json.loads((tokenizer_from / "config.json").read_text())
    config = {**COMMON, "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": layers}
    config.update(head_dim=head_dim, tie_word_embeddings=spec["tie"], torch_dtype="bfloat16")
    config.update(bos_token_id=source.get("bos_token_id"), eos_token_id=source.get("eos_token_id"))
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    # Drawing 8 billion normals takes longer on 2 cores than the rest of the build: every matrix is a
    # window, at a random offset, of one pool of them repeated (the same cost to quantize and to run).
    pool = (torch.randn(1 << 22, generator=gen) * 0.02).to(torch.bfloat16)

    def randn(*size: int) -> torch.Tensor:
        count = int(torch.tensor(size).prod())
        start = int(torch.randint(0, pool.numel(), (1,), generator=gen))
        reps = (start + count) // pool.numel() + 1
        return pool.repeat(reps)[start : start + count].reshape(size).clone()

    weight_map: dict[str, str] = {}

    def shard(name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))

    shard("embed.safetensors", {"model.embed_tokens.weight": randn(vocab, h)})
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj": (heads * head_dim, h),
            "self_attn.k_proj": (kv * head_dim, h),
            "self_attn.v_proj": (kv * head_dim, h),
            "self_attn.o_proj": (h, heads * head_dim),
            "mlp.gate_proj": (inter, h),
            "mlp.up_proj": (inter, h),
            "mlp.down_proj": (h, inter),
        }
        tensors = {f"{p}{name}.weight": randn(*size) for name, size in shapes.items()}
        tensors[f"{p}input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        tensors[f"{p}post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        shard(f"layer-{i:03d}.safetensors", tensors)
    head = {"model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    if not spec["tie"]:
        head["lm_head.weight"] = randn(vocab, h)
    shard("head.safetensors", head)
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in SMALL_FILES:
        if name != "config.json" and (tokenizer_from / name).is_file():
            shutil.copy2(tokenizer_from / name, out / name)
    return out


def filled(lm, base, ids: list[int]):
    """A session holding ``ids`` whose KV is ``base``'s, repeated to ``len(ids)`` positions."""
    from kvsnap.engine.session import Session

    session, n, have = Session(lm), len(ids), base.num_tokens
    session.cache.reserve(n + 256, lm.layout, lm.device)
    for src, dst in zip(base.cache.layers, session.cache.layers):
        keys, values = dst.extend(n, src.keys[:, :, :1].expand(-1, -1, n, -1))
        for start in range(0, n, have):
            m = min(have, n - start)
            keys[:, :, start : start + m].copy_(src.keys[:, :, :m])
            values[:, :, start : start + m].copy_(src.values[:, :, :m])
    session.tokens, session.last_logits = list(ids), base.last_logits
    return session


def measure(lm, folder: Path, n: int, new_tokens: int, work: Path, base=None) -> tuple[dict, object]:
    """One length's row, and its session (``base``: fill from that session's KV instead of prefilling)."""
    from kvsnap.config import SamplingParams
    from kvsnap.engine.session import Session

    ids = document(lm.tokenizer, n)
    t0 = time.perf_counter()
    if base is None:
        session = Session(lm)
        session.prefill(ids)
    else:
        session = filled(lm, base, ids)
    prefill_s = time.perf_counter() - t0
    path = work / f"{n}.kv"
    t0 = time.perf_counter()
    session.save(path)
    save_s = time.perf_counter() - t0
    if base is not None:
        session = None  # a filled row's cache is not kept: the restore beside it must fit too
    kv_bytes = n * lm.layout.bytes_per_token  # raw, as restored into memory
    resumed = Session(lm)
    t0 = time.perf_counter()
    stats = resumed.restore(path, ids)
    restore_s = time.perf_counter() - t0
    assert stats.hit_tokens == n, stats
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, stop_loops=False)
    t0 = time.perf_counter()
    made = resumed.generate(params).token_ids
    decode = (len(made) - 1) / (time.perf_counter() - t0)
    row = {
        "tokens": n,
        "filled_from": base.num_tokens if base is not None else None,
        "prefill_s": prefill_s if base is None else None,
        "prefill_tok_s": n / prefill_s if base is None else None,
        "save_s": save_s,
        "save_gb_s": kv_bytes / save_s / 1e9,
        "restore_s": restore_s,
        "restore_gb_s": kv_bytes / restore_s / 1e9,
        "kv_mb": kv_bytes / 1e6,
        "file_mb": path.stat().st_size / 1e6,
        "decode_tok_s": decode,
    }
    return row, session


def cli_checks(folder: Path, quantize: str, n: int, work: Path) -> dict:
    """run --save, run --resume, a chat turn resuming it, run --store twice: each reuses what was kept."""
    base = [sys.executable, "-m", "kvsnap_cli.main"]
    model = ["--model", str(folder), "--quantize", quantize, "--device", "cpu"]
    prompt = work / "prompt.txt"
    prompt.write_text(" ".join(["the river city market north winter light paper"] * (n // 8)))
    snap, store = work / "cli.kv", work / "store"
    out: dict[str, object] = {}

    def run(*args: str, stdin: str | None = None) -> dict:
        t0 = time.perf_counter()
        proc = subprocess.run([*base, *args], input=stdin, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"kvsnap {' '.join(args[:2])} failed: {proc.stderr[-2000:]}")
        result = json.loads(proc.stdout.strip().splitlines()[-1]) if "--json" in args else {}
        result["wall_s"] = time.perf_counter() - t0
        return result

    common = ["--prompt-file", str(prompt), "--temperature", "0", "--json"]
    saved = run("run", *model, *common, "--max-new-tokens", "0", "--save", str(snap))
    resumed = run("run", *model, *common, "--max-new-tokens", "4", "--resume", str(snap))
    assert resumed["hit_tokens"] > 0, resumed
    run("chat", *model, "--resume", str(snap), "--max-new-tokens", "4", stdin="And then?\n/exit\n")
    first = run("run", *model, *common, "--max-new-tokens", "2", "--store", str(store))
    again = run("run", *model, *common, "--max-new-tokens", "2", "--store", str(store))
    assert again["hit_tokens"] > 0, again
    out.update(
        save_wall_s=saved["wall_s"],
        resume_wall_s=resumed["wall_s"],
        resume_hit_tokens=resumed["hit_tokens"],
        store_first_wall_s=first["wall_s"],
        store_again_hit_tokens=again["hit_tokens"],
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--quantize", nargs="+", choices=["int8", "int4"], default=["int4"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--folder", type=Path, help="where the model is (built there when absent)")
    parser.add_argument("--cli-tokens", type=int, default=256, help="prompt tokens of the CLI checks (0: skip)")
    parser.add_argument("--tokenizer-from", default="smollm2-135m", help="model whose tokenizer the folder gets")
    parser.add_argument("--real-tokens", type=int, help="fill longer contexts from the longest real prefill")
    args = parser.parse_args()

    from kvsnap.models import load_model, resolve_model

    folder = args.folder or Path(tempfile.gettempdir()) / f"kvsnap-shaped-{args.shape}"
    built_s = None
    if not (folder / "config.json").is_file():
        t0 = time.perf_counter()
        build(args.shape, folder, Path(resolve_model(args.tokenizer_from, install=True)))
        built_s = time.perf_counter() - t0
    folder_bytes = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    rows, cli = [], {}
    for quantize in args.quantize:
        mem = weights_memory(str(folder), quantize)
        lm = load_model(str(folder), device="cpu", quantize=quantize)
        assert lm.backend == "native" and lm.quantization == quantize, (lm.backend, lm.quantization)
        with tempfile.TemporaryDirectory(prefix="kvsnap-shaped-") as tmp:
            base = None
            for n in sorted(args.lengths):
                row = {"quantize": quantize, "weights_rss_gb": mem["rss"] / 1e9, "load_peak_gb": mem["peak"] / 1e9}
                row["load_s"] = mem["load_s"]
                fill = args.real_tokens is not None and n > args.real_tokens
                if fill and base is None:
                    raise SystemExit(f"--real-tokens {args.real_tokens}: no length at most that to fill {n} from")
                measured, session = measure(lm, folder, n, args.new_tokens, Path(tmp), base if fill else None)
                if not fill:
                    base = session
                row.update(measured)
                rows.append(row)
                print(json.dumps(row), flush=True)
            del base
            if args.cli_tokens:
                cli[quantize] = cli_checks(folder, quantize, args.cli_tokens, Path(tmp))
                print(json.dumps(cli[quantize]), flush=True)
        del lm

    info = machine()
    print(describe(info))
    built = f", built in {built_s:.0f} s" if built_s else ""
    print(f"{args.shape}-shaped, random weights: bfloat16 folder {folder_bytes / 1e9:.2f} GB{built}")
    columns = [
        ("quantize", "weights", "s"),
        ("weights_rss_gb", "RSS GB", ".2f"),
        ("load_peak_gb", "load peak GB", ".2f"),
        ("load_s", "load s", ".0f"),
        ("tokens", "tokens", "d"),
        ("filled_from", "filled from", "d"),
        ("prefill_tok_s", "prefill tok/s", ".1f"),
        ("decode_tok_s", "decode tok/s", ".2f"),
        ("save_gb_s", "save GB/s", ".2f"),
        ("restore_gb_s", "restore GB/s", ".2f"),
        ("kv_mb", "KV MB", ".0f"),
        ("file_mb", "file MB", ".0f"),
    ]
    print(table(rows, columns))
    for quantize, checks in cli.items():
        said = (f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in checks.items())
        print(f"CLI ({quantize}): " + ", ".join(said))
    payload = {"machine": info, "shape": args.shape, "folder_bytes": folder_bytes, "rows": rows, "cli": cli}
    print(f"wrote {write_json('shaped_quantized', payload)}")


if __name__ == "__main__":
    main()
