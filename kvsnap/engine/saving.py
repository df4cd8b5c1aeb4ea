"""Writing a session to a ``.kv`` file: blocks encoded earlier are written as they are, new ones
encoded in parallel threads, the file replaced atomically."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvsnap.engine import verify as verifying
from kvsnap.engine.results import SaveStats
from kvsnap.format.meta import SnapshotHeader
from kvsnap.format.writer import write_snapshot
from kvsnap.types import EncodedBlock

if TYPE_CHECKING:
    from kvsnap.engine.session import Session


def encode_blocks(session: Session, tokens: Sequence[int], first: int = 0) -> tuple[list[EncodedBlock], int]:
    """Blocks ``first``.. of ``tokens`` as stored, and how many had to be encoded now (the rest were
    encoded earlier in the session, or read from a snapshot, and are kept as they are)."""
    return session._encoded.encode(
        session.cache,
        tokens,
        first,
        block_size=session.block_size,
        root=session.root(),
        codec=session.codec,
        level=session.level,
        storage_dtype=session.storage_dtype,
    )


def save(session: Session, path: str | Path, *, flush: bool = True) -> SaveStats:
    """See ``Session.save``."""
    t0 = time.perf_counter()
    flushed = session.flush() if flush else 0
    n = len(session.tokens)
    final, encoded = encode_blocks(session, session.tokens)
    logits = session.last_logits.float().cpu().numpy() if session.last_logits is not None else None
    header = SnapshotHeader(
        model=session.lm.name,
        fingerprint=session.lm.fingerprint,
        root=session.root(),
        layout=session.lm.layout,
        block_size=session.block_size,
        codec=session.codec,
        level=session.level,
        fingerprint_parts=session.lm.fingerprint_parts,
        storage_dtype=session.storage_dtype,
        # Lets inspect find the tokenizer of a model named by a relative path, a .gguf or a hub id.
        extra={"model_folder": str(Path(session.lm.folder).resolve()), **verifying.recorded(session)},
    )
    size = write_snapshot(path, header, session.tokens, final, last_logits=logits, messages=session.messages)
    session._encoded.keep_only({b.hash for b in final if b.hash is not None}, keep_tail=True)
    return SaveStats(
        path=str(path),
        tokens=n,
        blocks=len(final),
        blocks_encoded=encoded,
        blocks_reused=len(final) - encoded,
        flushed_tokens=flushed,
        kv_bytes=n * session.lm.layout.bytes_per_token,
        file_bytes=size,
        seconds=time.perf_counter() - t0,
    )
