"""What a snapshot holds and what a prompt would reuse from it, without loading the model.

Used by ``kvsnap inspect``. Imports no torch, ever: the tokenizer comes from the model folder's
``tokenizer.json`` through the ``tokenizers`` library (the same backend transformers' fast
tokenizers run). A model without that file gets no text preview rather than a transformers
import (hundreds of MB and seconds for a look at a file).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvsnap import prefix, provenance
from kvsnap.config import DEFAULT_CHUNK_SIZE
from kvsnap.engine import explain_sources
from kvsnap.format.meta import SEALED_VERSION
from kvsnap.format.reader import Snapshot
from kvsnap.format.sealed import CIPHER
from kvsnap.models.locate import LightTokenizer

if TYPE_CHECKING:
    from kvsnap.engine.explain import Running


def describe(
    path: str | Path,
    *,
    prompt_ids: list[int] | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    verify: bool = False,
    tokenizer: LightTokenizer | None = None,
    preview_tokens: int = 24,
    running: Running | None = None,
) -> dict[str, Any]:
    """A JSON-able description of a snapshot; with ``prompt_ids``, the hit stats and chunk plan, and
    with a tokenizer too, where and why reuse stops (``miss``; ``running`` adds the model's and
    namespace's check, see ``explain``)."""
    with Snapshot(path) as snap:
        meta = snap.meta
        info: dict[str, Any] = {
            "path": str(path),
            "model": meta.model,
            "fingerprint": meta.fingerprint,
            "format_version": meta.format_version,
            "tokens": meta.num_tokens,
            "blocks": len(meta.blocks),
            "block_size": meta.block_size,
            "codec": meta.codec,
            "level": meta.level,
            "layout": meta.layout.to_json(),
            "storage_dtype": meta.storage_layout.dtype,
            "kv_bytes": meta.kv_bytes,
            "stored_bytes": meta.stored_bytes,
            "file_bytes": snap.file_bytes,
            "ratio": round(snap.file_bytes / meta.kv_bytes, 4) if meta.kv_bytes else None,
            "bytes_per_token": round(snap.file_bytes / meta.num_tokens, 1) if meta.num_tokens else None,
            "last_logits": meta.logits_checksum is not None,
            "chat_turns": len(meta.messages) if meta.messages is not None else None,
            "created_at": meta.created_at,
            "made_by": provenance.parse(meta.extra.get("made_by")),
        }
        if snap.sealing is not None:
            info["format_version"] = SEALED_VERSION
            info["encrypted"] = {"cipher": CIPHER, "key_id": snap.sealing.key_id}
        if meta.messages is not None:
            info["messages"] = [dict(m) for m in meta.messages]
            info["dropped_messages"] = meta.dropped_messages  # out of the model's view (kvsnap.types.chat_view)
        if tokenizer is not None and meta.num_tokens:
            head = snap.tokens[:preview_tokens]
            tail = snap.tokens[-preview_tokens:] if meta.num_tokens > preview_tokens else []
            info["preview_start"] = tokenizer.decode(head)
            info["preview_end"] = tokenizer.decode(tail) if tail else ""
        if verify:
            problems = snap.verify()
            info["verified"] = not problems
            info["problems"] = problems
        if prompt_ids is not None:
            match = prefix.match_prefix(prompt_ids, snap.tokens, meta.block_hashes, meta.block_size, meta.root)
            whole = match.hit_tokens == meta.num_tokens and meta.logits_checksum is not None
            plan = prefix.plan_prefill(len(prompt_ids), match.hit_tokens, chunk_size, logits_at_hit=whole)
            info.update(
                prefix.Ledger.of(plan).as_dict(),
                chunk_sizes=plan.chunk_sizes,
                blocks_to_read=match.num_blocks,
                logits_source=plan.logits_source,
            )
    if prompt_ids is not None and tokenizer is not None:
        info["miss"] = explain_sources.against_snapshot(path, prompt_ids, tokenizer.decode, running).as_dict()
    return info
