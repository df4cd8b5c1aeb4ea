"""Cold prefill vs resumed TTFT, save time and snapshot size, side by side in one run.

For each prompt length: a snapshot holds the prompt minus a 32-token suffix; "resumed" restores
it and prefills the suffix. Baselines in the same run: torch.save/torch.load of the KV
tensors (what one writes by hand), and the same KV written uncompressed with plain
safetensors and read back (the read-speed limit for this data here).

    .venv/bin/python benchmarks/resume.py                # 512 1024 2048 4096 8000
    .venv/bin/python benchmarks/resume.py --lengths 2048 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from benchmarks.common import (  # noqa: E402
    best_of,
    best_of_each,
    describe,
    document,
    kept,
    machine,
    model_arguments,
    run_child,
    synced,
    table,
    write_json,
)
from kvsnap.config import SamplingParams  # noqa: E402
from kvsnap.engine.encoded import EncodedBlocks  # noqa: E402
from kvsnap.engine.session import Session  # noqa: E402
from kvsnap.format import Snapshot  # noqa: E402
from kvsnap.models import load_model  # noqa: E402

SUFFIX = 32
ONE = SamplingParams(max_new_tokens=1, temperature=0)


# One measurement in a new process, as `kvsnap run` pays it: nothing of an earlier run is left in
# the allocator (in one long process, freed buffers are handed out again with their pages
# already mapped, which flatters whichever reader allocates in small pieces), and the first
# forward of the process (kernel set-up) is part of a cold or resumed run's TTFT.
_CHILD = """
import json, sys, time
sys.path.insert(0, {root!r})
import torch
kind, path, device, tokens = {kind!r}, {path!r}, {device!r}, {tokens!r}
def sync():
    if device != "cpu":
        torch.cuda.synchronize()
if kind in ("cold", "resumed", "resumed_prefetch"):
    if kind == "resumed_prefetch":  # as the CLI does: the snapshot decodes while the model loads
        from kvsnap.format import prefetch
        prefetch.start(path)
    from benchmarks.common import document
    from kvsnap.models import load_model
    from kvsnap.config import SamplingParams
    from kvsnap.engine.session import Session
    lm = load_model({model!r}, device=device, dtype={dtype!r})
    ids = document(lm.tokenizer, tokens)
    resume = path if kind != "cold" else None
    result = Session(lm).run(ids, SamplingParams(max_new_tokens=1, temperature=0), resume=resume)
    assert kind == "cold" or result.prefill_tokens == {suffix}, result
    print(json.dumps({{"seconds": result.ttft_s}}))
    sys.exit(0)
if kind == "restore":
    from kvsnap.models import load_model
    from kvsnap.engine.session import Session
    from kvsnap.format import Snapshot
    lm = load_model({model!r}, device=device, dtype={dtype!r})
    with Snapshot(path) as snap:
        ids = snap.tokens
    t0 = time.perf_counter()
    session = Session(lm)  # kept: the timing ends with the cache delivered, not torn down
    session.restore(path, ids)
    sync()
else:
    from safetensors.torch import load_file
    if device != "cpu":
        torch.zeros(1, device=device); sync()
    t0 = time.perf_counter()
    tensors = load_file(path, device=device)
    if device == "cpu":
        tensors = [t.clone() for t in tensors.values()]
    sync()
print(json.dumps({{"seconds": time.perf_counter() - t0}}))
"""


def in_new_process(kind: str, path: Path, lm, model: str, dtype: str, tokens: int = 0) -> float:
    code = _CHILD.format(
        root=str(Path(__file__).resolve().parent.parent),
        kind=kind,
        path=str(path),
        device=str(lm.device),
        model=model,
        dtype=dtype,
        tokens=tokens,
        suffix=SUFFIX,
    )
    return json.loads(run_child(code))["seconds"]


def kv_tensors(cache) -> dict[str, torch.Tensor]:
    out = {}
    for i, layer in enumerate(cache.layers):
        out[f"k{i}"] = layer.keys.contiguous()
        out[f"v{i}"] = layer.values.contiguous()
    return out


def measure(lm, n: int, repeats: int, folder: Path, model: str, dtype: str, codec: str) -> dict:
    ids = document(lm.tokenizer, n)
    prefix_ids = ids[: n - SUFFIX]
    snap = folder / f"doc{n}.kv"
    dev = lm.device

    primer = Session(lm, codec=codec)
    primer.prefill(prefix_ids)
    save_s, _ = best_of(repeats, synced(dev, lambda: Session.save(_fresh_copy(primer), snap)))

    def in_memory():
        # The prefix already in the session, as between two chat turns: only the suffix runs.
        # This is the floor of any resume: what remains if loading took no time at all.
        s = Session(lm)
        s.restore(snap, prefix_ids)
        return s.run(ids, ONE)

    runs = best_of_each(
        repeats,
        {
            "cold": lambda: Session(lm).run(ids, ONE),
            "resumed": lambda: Session(lm).run(ids, ONE, resume=snap),
            "in_memory": in_memory,
        },
    )
    ttft = {name: min(r.ttft_s for r in results) for name, (_, results) in runs.items()}
    result = runs["resumed"][1][-1]
    assert result.hit_tokens == n - SUFFIX and result.prefill_tokens == SUFFIX, result

    # Baselines: (a) torch.save of the KV tensors, what one writes by hand (not of the cache
    # object: transformers' cache class on a GPU is local to kvsnap's adapter and does not pickle); (b) the same KV
    # uncompressed in plain safetensors, read into memory (load_file maps the file lazily; clone()
    # makes it really read, as a restore must) or onto the GPU.
    pt = folder / f"doc{n}.pt"
    st = folder / f"doc{n}.safetensors"
    tensors = kv_tensors(primer.cache)
    torch_save_s, _ = best_of(repeats, lambda: torch.save(tensors, pt))
    st_save_s, _ = best_of(repeats, lambda: save_file(tensors, str(st)))
    if dev.type == "cpu":
        st_read = lambda: [t.clone() for t in load_file(str(st)).values()]  # noqa: E731
    else:
        st_read = lambda: load_file(str(st), device=str(dev))  # noqa: E731
    reads = best_of_each(
        repeats + 1,
        {
            # Each reader returns what it read, so freeing it is not timed (for any of them).
            "restore": synced(dev, lambda: kept(Session(lm), "restore", snap, prefix_ids)),
            "safetensors": synced(dev, st_read),
            "torch_load": synced(dev, lambda: torch.load(pt, weights_only=True, map_location=dev)),
        },
    )
    restore_s, st_load_s, torch_load_s = (reads[k][0] for k in ("restore", "safetensors", "torch_load"))
    fresh = best_of_each(
        repeats,
        {
            "restore": lambda: in_new_process("restore", snap, lm, model, dtype),
            "safetensors": lambda: in_new_process("safetensors", st, lm, model, dtype),
            "cold": lambda: in_new_process("cold", snap, lm, model, dtype, n),
            "resumed": lambda: in_new_process("resumed", snap, lm, model, dtype, n),
            "resumed_prefetch": lambda: in_new_process("resumed_prefetch", snap, lm, model, dtype, n),
        },
    )
    new_restore_s, new_st_s, new_cold_s, new_resumed_s, new_prefetched_s = (
        min(fresh[k][1]) for k in ("restore", "safetensors", "cold", "resumed", "resumed_prefetch")
    )

    with Snapshot(snap) as s:
        kv_bytes = s.meta.kv_bytes
    file_bytes = snap.stat().st_size
    return {
        "tokens": n,
        "cold_ttft_s": ttft["cold"],
        "resumed_ttft_s": ttft["resumed"],
        "speedup": ttft["cold"] / ttft["resumed"],
        "in_memory_ttft_s": ttft["in_memory"],
        "ideal_speedup": ttft["cold"] / ttft["in_memory"],
        "restore_s": restore_s,
        "save_s": save_s,
        "kv_bytes": kv_bytes,
        "file_bytes": file_bytes,
        "ratio": file_bytes / kv_bytes,
        "bytes_per_token": file_bytes / (n - SUFFIX),
        "read_mb_s": kv_bytes / restore_s / 1e6,
        "torch_save_s": torch_save_s,
        "torch_load_s": torch_load_s,
        "torch_file_bytes": pt.stat().st_size,
        "st_save_s": st_save_s,
        "st_load_s": st_load_s,
        "restore_vs_st_load": restore_s / st_load_s,
        "new_process_cold_ttft_s": new_cold_s,
        "new_process_resumed_ttft_s": new_resumed_s,
        "new_process_speedup": new_cold_s / new_resumed_s,
        "new_process_prefetched_ttft_s": new_prefetched_s,
        "new_process_restore_s": new_restore_s,
        "new_process_st_load_s": new_st_s,
        "new_process_restore_vs_st_load": new_restore_s / new_st_s,
    }


def _fresh_copy(session: Session) -> Session:
    """The primed session without its cached encodings, so every save is a full first save."""
    session.encoded = EncodedBlocks()
    return session


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8000])
    model_arguments(parser, codec=True)
    args = parser.parse_args()
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    # A prompt that fills the whole context leaves no position for the answer's first token, so a
    # run stops at once with no token and no TTFT: refuse such lengths before minutes of work.
    too_long = [n for n in args.lengths if lm.max_positions is not None and n >= lm.max_positions]
    if too_long:
        parser.error(f"--lengths {too_long}: a prompt must be shorter than the model's context ({lm.max_positions})")
    Session(lm).run(document(lm.tokenizer, 64), ONE)  # warm up kernels and allocator
    info = machine()
    name = "resume" if args.codec == "shuffle-zstd" else f"resume-{args.codec}"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.lengths:
            t0 = time.perf_counter()
            rows.append(measure(lm, n, args.repeats, Path(tmp), args.model, args.dtype, args.codec))
            print(f"  {n} tokens measured in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            # Written after every length, so a run stopped at a time limit keeps what it measured.
            payload = {"machine": info, "model": args.model, "dtype": lm.layout.dtype, "codec": args.codec}
            path = write_json(name, {**payload, "rows": rows})
    ttft_cols = [
        ("tokens", "tokens", "d"),
        ("cold_ttft_s", "cold TTFT s", ".3f"),
        ("resumed_ttft_s", "resumed TTFT s", ".3f"),
        ("speedup", "speedup", ".1f"),
        ("in_memory_ttft_s", "suffix only s", ".3f"),
        ("ideal_speedup", "ceiling", ".1f"),
        ("new_process_cold_ttft_s", "new process: cold s", ".3f"),
        ("new_process_resumed_ttft_s", "resumed s", ".3f"),
        ("new_process_speedup", "speedup", ".1f"),
        ("new_process_prefetched_ttft_s", "resumed, prefetched s", ".3f"),
        ("save_s", "save s", ".3f"),
        ("ratio", "file/raw", ".3f"),
        ("bytes_per_token", "bytes/token", ",.0f"),
    ]
    read_cols = [
        ("tokens", "tokens", "d"),
        ("restore_s", "restore s", ".3f"),
        ("st_load_s", "safetensors read s", ".3f"),
        ("torch_load_s", "torch.load s", ".3f"),
        ("restore_vs_st_load", "restore/read", ".2f"),
        ("new_process_restore_s", "new process: restore s", ".3f"),
        ("new_process_st_load_s", "safetensors read s", ".3f"),
        ("new_process_restore_vs_st_load", "restore/read", ".2f"),
    ]
    print(describe(info))
    print(
        f"model {args.model}, {lm.device}, {lm.layout.dtype}, codec {args.codec}, suffix {SUFFIX} tokens, "
        f"best of {args.repeats}"
    )
    print('"suffix only": the same prompt with the prefix already in memory (the floor of any resume);')
    print('"ceiling": cold TTFT / suffix only, the speedup a restore that took no time would give;')
    print('"new process": cold and resumed each run as a fresh `kvsnap run` would, its first forward included;')
    print('"prefetched": the snapshot decoded in a thread while the model loads, as the CLI does')
    print(table(rows, ttft_cols))
    print()
    print("reading the prefix back: kvsnap restore vs the same KV uncompressed (plain safetensors) and torch.load,")
    print("in this process (runs alternate) and each in a new process (as `kvsnap run --resume` pays it)")
    print(table(rows, read_cols))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
