"""What a request and a save report: plain values, for the ledger, ``--json`` and the UI."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["RestoreStats", "SaveStats", "TurnResult"]


@dataclass(frozen=True, slots=True)
class RestoreStats:
    path: str
    snapshot_tokens: int
    hit_tokens: int
    blocks_read: int
    seconds: float
    block_size: int = 0  # of the blocks read (a .kv file's own, which may differ from the session's)
    # Per block read, in order: kvsnap.provenance.encode of what computed its KV ("" unknown).
    made_by: tuple[str, ...] = ()


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
    miss: dict[str, Any] | None = None  # with explain: where reuse stopped and why (kvsnap.engine.explain.Miss)
    # Session.chat: turns that left the model's view for this one to fit the context (kvsnap.engine.chat_view).
    dropped_turns: int = 0
    # Session.chat with explain: where rendering the whole view again would differ from the ids the chat kept
    # and ran (kvsnap.engine.explain.Miss, the rendering as the prompt and the kept ids as the source).
    rerender: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of(cls, ledger: dict[str, Any], gen: Any, times: tuple[float, float, float, float], **more: Any) -> TurnResult:
        """A request's result from its reuse ledger (``prefix.Ledger.as_dict``), its ``Generation`` (None
        when nothing was generated), the clock at its start, after restore, prefill and decode, and the
        remaining fields."""
        t0, t1, t2, t3 = times
        first = gen.first_token_at if gen is not None else None
        return cls(
            **ledger,
            text=gen.text if gen is not None else "",
            new_tokens=len(gen.token_ids) if gen is not None else 0,
            stop_reason=gen.stop_reason if gen is not None else "none",
            ttft_s=round(first - t0, 6) if first is not None else None,
            restore_s=round(t1 - t0, 6),
            prefill_s=round(t2 - t1, 6),
            decode_s=round(t3 - t2, 6),
            total_s=round(t3 - t0, 6),
            **more,
        )


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
