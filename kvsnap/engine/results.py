"""What a request and a save report: plain values, for the ledger, ``--json`` and the UI."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvsnap.engine.restore import RestoreStats

__all__ = ["RestoreStats", "SaveStats", "TurnResult"]


@dataclass(frozen=True, slots=True)
class TurnResult:
    """One request: the reuse ledger, the generated text and where the time went."""

    prompt_tokens: int
    hit_tokens: int
    prefill_tokens: int  # tokens the model's forward really saw for this prompt
    reuse_ratio: float
    chunks: int
    logits_source: str  # "prefill" | "snapshot" | "backoff"
    text: str
    new_tokens: int
    stop_reason: str
    ttft_s: float | None
    restore_s: float
    prefill_s: float
    decode_s: float
    total_s: float
    restored_from: str | None = None
    restore_error: str | None = None  # the snapshot was refused and everything recomputed (on_mismatch="recompute")
    store_new_blocks: int | None = None  # blocks this request added to the block store (None: no store)
    # The block store could not be read or written (or held a damaged block) and this request went on without it.
    store_error: str | None = None
    # Load or recompute (--reuse): what was done with a stored prefix, why, and the predictions behind it.
    reuse_decision: str | None = None
    reuse_reason: str | None = None
    predicted_load_s: float | None = None
    predicted_recompute_s: float | None = None
    # --verify, or the automatic spot check when the KV's recorded versions or device differ (kvsnap.engine.verify):
    # the max |difference| of the recomputed vs the restored K/V, the check's seconds, and its details.
    verify_max_abs_diff: float | None = None
    verify_s: float | None = None
    verify: dict[str, Any] | None = None
    miss: dict[str, Any] | None = None  # with explain: where reuse stopped and why (kvsnap.explain.Miss)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class SaveStats:
    path: str
    tokens: int
    blocks: int
    blocks_encoded: int  # compressed in this save
    blocks_reused: int  # already compressed earlier in the session
    flushed_tokens: int  # sampled tokens run through the model so the file covers them
    kv_bytes: int
    file_bytes: int
    seconds: float
