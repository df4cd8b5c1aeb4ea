"""Check the resume path on a device (made for a lent GPU; runs anywhere): bitwise restore, the
same answer, only the suffix run, pinned staging, and the figures of one resume side by side.

Exits non-zero if a check fails. Prints one line per check and a JSON summary.

    python3 benchmarks/cuda_check.py --model FOLDER [--device cuda] [--tokens 2048]
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

from benchmarks.common import best_of_each, describe, document, machine, write_json  # noqa: E402
from kvsnap.config import SamplingParams  # noqa: E402
from kvsnap.engine import kv_transfer  # noqa: E402
from kvsnap.engine.session import Session  # noqa: E402
from kvsnap.models import load_model  # noqa: E402

SUFFIX = 32
GREEDY = SamplingParams(max_new_tokens=32, temperature=0)


def kv_of(session: Session, n: int) -> list[torch.Tensor]:
    out = []
    for layer in session.cache.layers:
        out += [layer.keys[:, :, :n], layer.values[:, :, :n]]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    n = args.tokens
    ids = document(lm.tokenizer, n)
    prefix_ids = ids[: n - SUFFIX]
    checks: dict[str, bool] = {}
    figures: dict[str, float | int | str | bool] = {"device": str(lm.device), "dtype": lm.layout.dtype, "tokens": n}
    Session(lm).run(ids[:64], SamplingParams(max_new_tokens=1, temperature=0))  # warm up

    with tempfile.TemporaryDirectory() as tmp:
        snap = Path(tmp) / "prefix.kv"
        # Reference: the prefix kept in memory, then the suffix and the answer.
        kept = Session(lm)
        kept.prefill(prefix_ids)
        kept.save(snap)
        reference_kv = [t.clone() for t in kv_of(kept, n - SUFFIX)]
        reference = kept.run(ids, GREEDY)

        # Record how the real restore staged its blocks (pinned or not) as it finishes.
        staged: list[bool] = []
        finish = kv_transfer.KVTransfer.finish

        staging: list[int] = []

        def recording_finish(self, config):
            staged.append(self.pinned)
            staging.append(self.staging_bytes)
            return finish(self, config)

        kv_transfer.KVTransfer.finish = recording_finish
        try:
            resumed_session = Session(lm)
            if lm.device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            resumed_session.restore(snap, prefix_ids)  # the process's first restore
            if lm.device.type == "cuda":
                torch.cuda.synchronize()  # the copy to the device is part of the restore
                figures["restore_peak_mb"] = (torch.cuda.max_memory_allocated() - before) / 1e6
            figures["first_restore_s"] = time.perf_counter() - t0
        finally:
            kv_transfer.KVTransfer.finish = finish
        checks["restored KV is bitwise the saved KV"] = all(
            torch.equal(a, b) for a, b in zip(kv_of(resumed_session, n - SUFFIX), reference_kv)
        )
        resumed = Session(lm).run(ids, GREEDY, resume=snap)
        checks["resumed answer equals the in-memory answer"] = resumed.text == reference.text
        checks["only the suffix ran"] = (resumed.hit_tokens, resumed.prefill_tokens) == (n - SUFFIX, SUFFIX)
        if lm.device.type == "cuda":
            checks["restore staged its blocks in pinned host memory"] = staged == [True]
            # The ring of pinned slots, not a buffer the size of the prefix.
            figures["staging_mb"] = max(staging) / 1e6
            checks["restore staged at most a few blocks"] = max(staging) < (n - SUFFIX) * lm.layout.bytes_per_token / 4
        cold = Session(lm).run(ids, GREEDY)
        # Not a check: a cold run splits the prompt into other chunks, and bf16 GPU kernels may round
        # differently for another number of rows. Reported so a difference is seen, not hidden.
        figures["cold_answer_equal"] = cold.text == resumed.text
        figures["resumed_ttft_s"] = resumed.ttft_s or 0.0
        figures["cold_ttft_s"] = cold.ttft_s or 0.0
        figures["speedup"] = figures["cold_ttft_s"] / max(figures["resumed_ttft_s"], 1e-9)
        figures["file_mb"] = snap.stat().st_size / 1e6
        if lm.device.type == "cuda":
            # Pinned vs pageable staging of the restored blocks: the first pinned restore of a
            # process pays for pinning; later ones reuse torch's cached pinned blocks.
            def restore(pin: bool):
                kv_transfer.PIN_STAGING = pin
                try:
                    Session(lm).restore(snap, prefix_ids)
                    torch.cuda.synchronize()
                finally:
                    kv_transfer.PIN_STAGING = True

            # The same prefix stored raw (no entropy stage at all), and a plain pinned host-to-device
            # copy of as many bytes: the copy engine's speed, which a restore approaches at best.
            raw_snap = snap.with_name("raw.kv")
            raw_primer = Session(lm, codec="raw")
            raw_primer.prefill(prefix_ids)
            raw_primer.save(raw_snap)
            kv_bytes = len(prefix_ids) * lm.layout.bytes_per_token
            host = torch.empty(kv_bytes, dtype=torch.uint8, pin_memory=True)
            on_device = torch.empty(kv_bytes, dtype=torch.uint8, device=lm.device)

            def copy() -> None:
                on_device.copy_(host, non_blocking=True)
                torch.cuda.synchronize()

            def restore_raw() -> None:
                Session(lm, codec="raw").restore(raw_snap, prefix_ids)
                torch.cuda.synchronize()

            times = best_of_each(
                3,
                {
                    "pinned": lambda: restore(True),
                    "pageable": lambda: restore(False),
                    "raw": restore_raw,
                    "copy": copy,
                },
            )
            figures["restore_pinned_s"] = times["pinned"][0]
            figures["restore_pageable_s"] = times["pageable"][0]
            figures["restore_raw_s"] = times["raw"][0]
            figures["kv_bytes"] = kv_bytes
            figures["restore_gbps"] = kv_bytes / times["pinned"][0] / 1e9
            figures["restore_raw_gbps"] = kv_bytes / times["raw"][0] / 1e9
            figures["pinned_copy_gbps"] = kv_bytes / times["copy"][0] / 1e9

    info = machine()
    print(describe(info))
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    print(json.dumps(figures, indent=1))
    print(f"wrote {write_json('cuda_check', {'machine': info, 'checks': checks, 'figures': figures})}")
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
