"""The block index as JSON (``DIR/index.json``) and back; reading checks everything. No files, no torch."""

from __future__ import annotations

import json
from typing import Any

from kvsnap import hashing, provenance
from kvsnap.errors import StoreError
from kvsnap.store.index import COUNTERS, INDEX_FORMAT, INDEX_VERSION, BlockIndex
from kvsnap.store.records import BlockRecord, ChainInfo, SessionRecord
from kvsnap.types import KVLayout


def index_to_json(index: BlockIndex) -> dict[str, Any]:
    # Blocks name their provenance by its place in one table: a store holds few distinct ones.
    producers = sorted({r.made_by for r in index.blocks.values() if r.made_by})
    producer = {text: i for i, text in enumerate(producers)}
    return {
        "format": INDEX_FORMAT,
        "version": INDEX_VERSION,
        "hash_scheme": hashing.HASH_SCHEME,
        "budget_bytes": index.budget_bytes,
        "clock": index.clock,
        "counters": index.counters,
        "chains": [
            {
                "root": c.root.hex(),
                "model": c.model,
                "fingerprint": c.fingerprint,
                "layout": c.layout.to_json(),
                "block_size": c.block_size,
                **({"fingerprint_parts": dict(c.parts)} if c.parts else {}),
            }
            for c in index.chains.values()
        ],
        "made_by": [json.loads(text) for text in producers],
        "blocks": [
            {
                "hash": r.hash.hex(),
                "parent": r.parent.hex(),
                "root": r.root.hex(),
                "tokens": list(r.token_ids),
                "full": r.full,
                "raw_bytes": r.raw_bytes,
                "stored_bytes": r.stored_bytes,
                "checksum": r.checksum,
                "codec": r.codec,
                "level": r.level,
                "last_use": index.last_use[r.hash],
                **({"made_by": producer[r.made_by]} if r.made_by else {}),
            }
            for r in index.blocks.values()
        ],
        "sessions": [
            {
                "name": s.name,
                "root": s.root.hex(),
                "tokens": list(s.token_ids),
                "hashes": [h.hex() for h in s.hashes],
                "pinned": s.pinned,
                "messages": list(s.messages) if s.messages is not None else None,
                "extra": s.extra,
                "logits": s.logits,
            }
            for s in index.sessions.values()
        ],
    }


def index_from_json(data: Any) -> BlockIndex:
    """Rebuild an index from ``to_json`` output; anything malformed raises ``StoreError``."""
    if not isinstance(data, dict) or data.get("format") != INDEX_FORMAT:
        raise StoreError("not a kvsnap store index")
    if data.get("version") != INDEX_VERSION:
        raise StoreError(f"store index version {data.get('version')!r} is not one this kvsnap reads")
    if data.get("hash_scheme") != hashing.HASH_SCHEME:
        raise StoreError(f"unknown hash scheme {data.get('hash_scheme')!r}")
    try:
        index = BlockIndex(_opt_int(data["budget_bytes"]))
        saved_clock = int(data["clock"])
        index.counters.update({k: int(data["counters"].get(k, 0)) for k in COUNTERS})
        for c in data["chains"]:
            index.add_chain(
                ChainInfo(
                    bytes.fromhex(c["root"]),
                    str(c["model"]),
                    str(c["fingerprint"]),
                    _layout(c["layout"]),
                    int(c["block_size"]),
                    _parts(c.get("fingerprint_parts")),
                )
            )
        table = data.get("made_by")
        producers = [provenance.encode(provenance.parse(p)) for p in table] if isinstance(table, list) else []
        pending = [_block_from_json(b, producers) for b in data["blocks"]]
        # Parents before children, whatever order the file lists them in.
        by_parent: dict[bytes, list[tuple[BlockRecord, int]]] = {}
        for record, last_use in pending:
            by_parent.setdefault(record.parent, []).append((record, last_use))
        stack = [r for r in index.chains]
        while stack:
            parent = stack.pop()
            for record, last_use in by_parent.pop(parent, []):
                index.put(record)
                index.last_use[record.hash] = last_use
                stack.append(record.hash)
        if by_parent:
            raise StoreError(f"store index holds {sum(map(len, by_parent.values()))} blocks without a parent")
        # Loading touched every block; the saved clock (and the saved last uses) stand.
        index.clock = max([saved_clock, *index.last_use.values()])
        for s in data["sessions"]:
            messages = s.get("messages")
            index.set_session(
                SessionRecord(
                    name=str(s["name"]),
                    root=bytes.fromhex(s["root"]),
                    token_ids=tuple(int(t) for t in s["tokens"]),
                    hashes=tuple(bytes.fromhex(h) for h in s["hashes"]),
                    pinned=bool(s["pinned"]),
                    messages=tuple(dict(m) for m in messages) if messages is not None else None,
                    extra=dict(s.get("extra") or {}),
                    logits=s.get("logits"),
                )
            )
    except StoreError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise StoreError(f"store index is malformed ({type(exc).__name__}: {exc})") from None
    return index


def _layout(data: dict[str, Any]) -> KVLayout:
    try:
        return KVLayout.from_json(data)
    except ValueError as exc:
        raise StoreError(str(exc)) from None


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _parts(value: Any) -> tuple[tuple[str, str], ...]:
    """A chain's fingerprint parts; () when absent or not a mapping of strings (they only explain misses)."""
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return ()
    return tuple(sorted(value.items()))


def _made_by(value: Any, producers: list[str]) -> str:
    """A block's provenance from its place in the table; unknown ("") when it names none."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(producers):
        return producers[value]
    return ""


def _block_from_json(b: dict[str, Any], producers: list[str]) -> tuple[BlockRecord, int]:
    h = bytes.fromhex(b["hash"])
    if len(h) != hashing.DIGEST_SIZE:
        raise StoreError("store index holds a hash of the wrong length")
    record = BlockRecord(
        hash=h,
        parent=bytes.fromhex(b["parent"]),
        root=bytes.fromhex(b["root"]),
        token_ids=tuple(int(t) for t in b["tokens"]),
        full=bool(b["full"]),
        raw_bytes=int(b["raw_bytes"]),
        stored_bytes=int(b["stored_bytes"]),
        checksum=str(b["checksum"]),
        codec=str(b["codec"]),
        level=int(b["level"]),
        made_by=_made_by(b.get("made_by"), producers),
    )
    return record, int(b["last_use"])
