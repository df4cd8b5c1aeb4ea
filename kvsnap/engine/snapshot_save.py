"""Writing what a session holds to a ``.kv`` file: blocks encoded earlier are written as they are, new
ones encoded in parallel threads, the file replaced atomically."""

from __future__ import annotations

import time
from pathlib import Path

from kvsnap.engine.contents import Contents
from kvsnap.engine.results import SaveStats
from kvsnap.format.meta import SnapshotHeader
from kvsnap.format.writer import write_snapshot


def save(contents: Contents, path: str | Path, *, flushed: int = 0) -> SaveStats:
    """See ``Session.save``; ``flushed``: the sampled tokens the session ran just before, for the stats."""
    t0 = time.perf_counter()
    lm, fmt, n = contents.lm, contents.fmt, len(contents.tokens)
    final, encoded = contents.encode()
    made_by = {"made_by": contents.made_by} if contents.made_by is not None else {}
    header = SnapshotHeader(
        model=lm.name,
        fingerprint=lm.fingerprint,
        root=fmt.root(),
        layout=lm.layout,
        block_size=fmt.block_size,
        codec=fmt.codec,
        level=fmt.level,
        fingerprint_parts=lm.fingerprint_parts,
        storage_dtype=fmt.storage_dtype,
        # Lets inspect find the tokenizer of a model named by a relative path, a .gguf or a hub id.
        extra={"model_folder": str(Path(lm.folder).resolve()), **made_by, **contents.extra()},
    )
    logits = contents.logits_array()
    size = write_snapshot(
        path, header, contents.tokens, final, last_logits=logits, messages=contents.messages, key=contents.key
    )
    contents.encoded.keep_only({b.hash for b in final if b.hash is not None}, keep_tail=True)
    return SaveStats(
        path=str(path),
        tokens=n,
        blocks=len(final),
        blocks_encoded=encoded,
        blocks_reused=len(final) - encoded,
        flushed_tokens=flushed,
        kv_bytes=n * lm.layout.bytes_per_token,
        file_bytes=size,
        seconds=time.perf_counter() - t0,
    )
