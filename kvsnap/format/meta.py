"""The ``.kv`` format's values and its metadata parser: what a snapshot declares, checked.

Every field of ``__metadata__["kvsnap"]`` is validated here (types, ranges, consistency between
token counts, block sizes and byte sizes) before any block is read, so a damaged or hostile
header ends in one ``SnapshotError`` line and bounds everything read later. No torch here.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvsnap import hashing
from kvsnap.errors import ConfigError, SaveError, SnapshotError, SnapshotVersionError, one_line
from kvsnap.format import codec as codecs
from kvsnap.hashing import checksum
from kvsnap.limits import (
    MAX_BLOCK_BYTES,
    MAX_BLOCK_SIZE,
    MAX_FINGERPRINT_PARTS,
    MAX_LAYOUT_DIM,
    MAX_LEVEL,
    MAX_META_STRING,
    MAX_TOKENS,
    MIN_LEVEL,
    check_block_size,
    check_layout,
    check_level,
)
from kvsnap.types import DROPPED_MESSAGES, KV_DTYPES, EncodedBlock, KVLayout, chat_messages, dropped_messages

FORMAT_VERSION = 1  # what a plain snapshot is written as: every kvsnap reads it
SEALED_VERSION = 2  # an encrypted snapshot (kvsnap.format.sealed): kvsnap before it refuses the file
READABLE_VERSIONS = (1, 2)
# The bounds a reader enforces are kvsnap.limits' one table; the writer checks the same ones first
# (``SnapshotHeader.check``, ``check_contents``): what kvsnap writes, it reads.


@dataclass(frozen=True, slots=True)
class SnapshotHeader:
    """Who a snapshot's KV belongs to and how its blocks are stored: everything but the content.

    One object instead of a dozen keyword arguments wherever a snapshot is written (a session's
    save, a store export, golden files, tests).
    """

    model: str
    fingerprint: str
    root: bytes  # chain root: fingerprint + namespace + block size
    layout: KVLayout  # the cache's layout
    block_size: int
    codec: str = codecs.DEFAULT_CODEC
    level: int = codecs.DEFAULT_LEVEL
    fingerprint_parts: dict[str, str] = field(default_factory=dict)  # lets a refusal say which part differs
    storage_dtype: str | None = None  # opt-in narrower block bytes (lossy); None: the layout's dtype
    extra: dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        """Refuse, before anything is written, a header the reader would refuse (``SaveError``)."""
        if self.codec not in codecs.ALL_CODECS:
            raise SaveError(f"cannot write a snapshot with unknown codec {self.codec!r}")
        if self.storage_dtype is not None and self.storage_dtype not in KV_DTYPES:
            raise SaveError(f"cannot write a snapshot with unknown storage dtype {self.storage_dtype!r}")
        strings = [self.model, self.fingerprint, *self.fingerprint_parts, *self.fingerprint_parts.values()]
        if any(not isinstance(v, str) or len(v) > MAX_META_STRING for v in strings):
            raise SaveError(
                f"cannot write a snapshot: model names and fingerprints are at most {MAX_META_STRING} characters"
            )
        if len(self.fingerprint_parts) > MAX_FINGERPRINT_PARTS:
            raise SaveError(f"cannot write a snapshot with over {MAX_FINGERPRINT_PARTS} fingerprint parts")
        try:
            check_block_size(self.block_size)
            check_level(self.level)
            check_layout(self.layout.with_dtype(self.storage_dtype or self.layout.dtype), self.block_size)
        except ConfigError as exc:
            raise SaveError(f"cannot write the snapshot: {exc}") from None


def check_contents(header: SnapshotHeader, num_tokens: int, blocks: Sequence[EncodedBlock]) -> None:
    """Refuse (``SaveError``) contents the reader would refuse: too many tokens, an oversized block."""
    if num_tokens > MAX_TOKENS:
        raise SaveError(f"cannot write the snapshot: {num_tokens:,} tokens, a .kv file holds at most {MAX_TOKENS:,}")
    for i, b in enumerate(blocks):
        if not 1 <= b.num_tokens <= header.block_size or b.raw_bytes > MAX_BLOCK_BYTES:
            raise SaveError(
                f"cannot write the snapshot: block {i} holds {b.num_tokens:,} tokens in {b.raw_bytes:,} bytes "
                f"(at most {header.block_size:,} tokens and {MAX_BLOCK_BYTES:,} bytes)"
            )


def build_meta(
    header: SnapshotHeader,
    *,
    tokens_checksum: str,
    num_tokens: int,
    blocks: Sequence[EncodedBlock],
    logits_checksum: str | None,
    messages: Sequence[dict[str, str]] | None,
) -> str:
    """The ``__metadata__["kvsnap"]`` JSON of a snapshot (ASCII, so chat text with lone surrogates
    from odd terminals still makes a valid file); ``SaveError`` for what the reader would refuse."""
    header.check()
    check_contents(header, num_tokens, blocks)
    if dropped_messages(header.extra or {}, messages) is None:
        raise SaveError(f"cannot write the snapshot: {DROPPED_MESSAGES} does not fit its chat messages")
    meta: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "hash_scheme": hashing.HASH_SCHEME,
        "model": header.model,
        "fingerprint": header.fingerprint,
        "root": header.root.hex(),
        "layout": {**header.layout.to_json(), "order": "layers,kv,kv_heads,tokens,head_dim"},
        "block_size": header.block_size,
        "codec": header.codec,
        "level": header.level,
        "num_tokens": num_tokens,
        "tokens_checksum": tokens_checksum,
        "blocks": [
            {
                "tokens": b.num_tokens,
                "hash": b.hash.hex() if b.hash is not None else None,
                "raw_bytes": b.raw_bytes,
                "stored_bytes": len(b.stored),
                "checksum": b.checksum,
            }
            for b in blocks
        ],
        "logits_checksum": logits_checksum,
        "messages": list(messages) if messages is not None else None,
        "created_at": time.time(),
        "extra": header.extra or {},
    }
    if header.storage_dtype is not None and header.storage_dtype != header.layout.dtype:
        meta["storage_dtype"] = header.storage_dtype
    if header.fingerprint_parts:
        meta["fingerprint_parts"] = dict(header.fingerprint_parts)
    return json.dumps(meta, separators=(",", ":"), ensure_ascii=True)


@dataclass(frozen=True, slots=True)
class BlockInfo:
    index: int
    num_tokens: int
    hash: bytes | None
    raw_bytes: int
    stored_bytes: int
    checksum: str


@dataclass(frozen=True, slots=True)
class SnapshotMeta:
    format_version: int
    model: str
    fingerprint: str
    root: bytes
    layout: KVLayout
    block_size: int
    codec: str
    level: int
    num_tokens: int
    tokens_checksum: str
    blocks: tuple[BlockInfo, ...]
    logits_checksum: str | None
    messages: tuple[dict[str, str], ...] | None
    created_at: float
    extra: dict[str, Any] = field(default_factory=dict)
    fingerprint_parts: dict[str, str] = field(default_factory=dict)
    storage_dtype: str = ""  # dtype of the stored block bytes; "" means the layout's dtype

    @property
    def storage_layout(self) -> KVLayout:
        """The layout the block bytes are in (the cache's, unless stored narrower)."""
        if not self.storage_dtype or self.storage_dtype == self.layout.dtype:
            return self.layout
        return self.layout.with_dtype(self.storage_dtype)

    @property
    def header(self) -> SnapshotHeader:
        return SnapshotHeader(
            model=self.model,
            fingerprint=self.fingerprint,
            root=self.root,
            layout=self.layout,
            block_size=self.block_size,
            codec=self.codec,
            level=self.level,
            fingerprint_parts=dict(self.fingerprint_parts),
            storage_dtype=self.storage_dtype or None,
            extra=dict(self.extra),
        )

    @property
    def dropped_messages(self) -> int:
        """Chat messages out of the model's view (``kvsnap.types.chat_view``); checked when the file was read."""
        return self.extra.get(DROPPED_MESSAGES, 0)

    @property
    def kv_bytes(self) -> int:
        return self.num_tokens * self.layout.bytes_per_token

    @property
    def stored_bytes(self) -> int:
        return sum(b.stored_bytes for b in self.blocks)

    @property
    def block_hashes(self) -> list[bytes]:
        return [b.hash for b in self.blocks if b.hash is not None]


def header_json(header_meta: dict[str, str] | None) -> dict[str, Any]:
    """The ``kvsnap`` JSON of a safetensors header, checksum verified, of a version this kvsnap reads."""
    if not header_meta or "kvsnap" not in header_meta:
        raise SnapshotError("not a kvsnap snapshot (safetensors file without kvsnap metadata)")
    text = header_meta["kvsnap"]
    if checksum(text.encode("utf-8", "surrogatepass")) != header_meta.get("kvsnap_checksum"):
        raise SnapshotError("metadata fails its checksum")
    raw = _json_object(text)
    version = raw.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise SnapshotError("metadata has no format_version")
    if version not in READABLE_VERSIONS:
        newer = "newer than" if version > max(READABLE_VERSIONS) else "not one"
        raise SnapshotVersionError(
            f"format version {version} is {newer} this kvsnap supports (reads {', '.join(map(str, READABLE_VERSIONS))})"
        )
    return raw


def parse_meta(header_meta: dict[str, str] | None) -> SnapshotMeta:
    """A plain (version 1) snapshot's metadata, checked."""
    raw = header_json(header_meta)
    if raw["format_version"] != FORMAT_VERSION:
        raise SnapshotError(f"format version {raw['format_version']} is not a plain snapshot's")
    return meta_from_json(raw)


def meta_from_text(text: str) -> SnapshotMeta:
    """The metadata a sealed snapshot holds inside (a plain snapshot's JSON, authenticated), checked."""
    raw = _json_object(text)
    if raw.get("format_version") != FORMAT_VERSION:
        raise SnapshotError("sealed metadata has no format version kvsnap knows")
    return meta_from_json(raw)


def _json_object(text: str) -> dict[str, Any]:
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError):
        raise SnapshotError("metadata is not valid JSON") from None
    if not isinstance(raw, dict):
        raise SnapshotError("metadata is not a JSON object")
    return raw


def meta_from_json(raw: dict[str, Any]) -> SnapshotMeta:
    try:
        return _meta_from_dict(raw)
    except SnapshotError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise SnapshotError(f"metadata is malformed ({type(exc).__name__}: {one_line(exc)})") from None


def _int(value: Any, name: str, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise SnapshotError(f"metadata field {name} is {value!r}, expected an integer in [{lo}, {hi}]")
    return value


def _str(value: Any, name: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_META_STRING:
        raise SnapshotError(f"metadata field {name} is not a string")
    return value


def _meta_from_dict(raw: dict[str, Any]) -> SnapshotMeta:
    if raw.get("hash_scheme") != hashing.HASH_SCHEME:
        raise SnapshotError(f"unknown hash scheme {raw.get('hash_scheme')!r}")
    lay = raw["layout"]
    dtype = lay["dtype"]
    if dtype not in KV_DTYPES:
        raise SnapshotError(f"unknown KV dtype {dtype!r}")
    layout = KVLayout(
        _int(lay["layers"], "layers", 1, MAX_LAYOUT_DIM),
        _int(lay["kv_heads"], "kv_heads", 1, MAX_LAYOUT_DIM),
        _int(lay["head_dim"], "head_dim", 1, MAX_LAYOUT_DIM),
        dtype,
    )
    block_size = _int(raw["block_size"], "block_size", 1, MAX_BLOCK_SIZE)
    storage_dtype = raw.get("storage_dtype", dtype)
    if storage_dtype not in KV_DTYPES:
        raise SnapshotError(f"unknown storage dtype {storage_dtype!r}")
    stored_layout = layout.with_dtype(storage_dtype)
    codec = raw["codec"]
    if codec not in codecs.ALL_CODECS:
        raise SnapshotError(f"unknown codec {codec!r} (this kvsnap knows {', '.join(codecs.ALL_CODECS)})")
    num_tokens = _int(raw["num_tokens"], "num_tokens", 0, MAX_TOKENS)
    blocks_raw = raw["blocks"]
    if not isinstance(blocks_raw, list) or len(blocks_raw) != -(-num_tokens // block_size):
        raise SnapshotError("block list does not match the token count")
    blocks = []
    for i, b in enumerate(blocks_raw):
        full = i < num_tokens // block_size
        n = _int(b["tokens"], f"blocks[{i}].tokens", 1, block_size)
        if n != (block_size if full else num_tokens - i * block_size):
            raise SnapshotError(f"block {i} declares {n} tokens, inconsistent with the block size")
        raw_bytes = _int(b["raw_bytes"], f"blocks[{i}].raw_bytes", 0, MAX_BLOCK_BYTES)
        if raw_bytes != n * stored_layout.bytes_per_token:
            raise SnapshotError(
                f"block {i} declares {raw_bytes} raw bytes, expected {n * stored_layout.bytes_per_token}"
            )
        # No codec output may exceed its input by more than a small header: bounds decompression input too.
        stored = _int(b["stored_bytes"], f"blocks[{i}].stored_bytes", 0, raw_bytes + 4096)
        # ... and the raw size by what the stored bytes can decode to: a small file cannot make a reader
        # allocate gigabytes (decode and the threads' scratch buffers are sized by raw_bytes).
        if raw_bytes > codecs.max_decoded_size(codec, stored):
            raise SnapshotError(f"block {i} declares {raw_bytes} raw bytes, more than {stored} stored bytes can hold")
        h = b["hash"]
        if full != (h is not None):
            raise SnapshotError(f"block {i} hash presence is inconsistent with its size")
        hash_ = bytes.fromhex(_str(h, "hash")) if h is not None else None
        if hash_ is not None and len(hash_) != hashing.DIGEST_SIZE:
            raise SnapshotError(f"block {i} hash has the wrong length")
        blocks.append(BlockInfo(i, n, hash_, raw_bytes, stored, _str(b["checksum"], "checksum")))
    messages = chat_messages(raw.get("messages"))
    if messages is False:
        raise SnapshotError("chat messages are malformed")
    root = bytes.fromhex(_str(raw["root"], "root"))
    logits_checksum = raw.get("logits_checksum")
    if logits_checksum is not None:
        logits_checksum = _str(logits_checksum, "logits_checksum")
    created = raw.get("created_at", 0.0)
    extra = raw.get("extra") or {}
    if not isinstance(extra, dict):
        raise SnapshotError("metadata field extra is not an object")
    if dropped_messages(extra, messages) is None:
        raise SnapshotError(f"metadata field {DROPPED_MESSAGES} does not fit the chat messages")
    return SnapshotMeta(
        format_version=raw["format_version"],
        model=_str(raw["model"], "model"),
        fingerprint=_str(raw["fingerprint"], "fingerprint"),
        root=root,
        layout=layout,
        block_size=block_size,
        codec=codec,
        level=_int(raw["level"], "level", MIN_LEVEL, MAX_LEVEL),
        num_tokens=num_tokens,
        tokens_checksum=_str(raw["tokens_checksum"], "tokens_checksum"),
        blocks=tuple(blocks),
        logits_checksum=logits_checksum,
        messages=messages,
        created_at=float(created) if isinstance(created, (int, float)) else 0.0,
        extra=extra,
        fingerprint_parts=_parts(raw.get("fingerprint_parts")),
        storage_dtype=storage_dtype if storage_dtype != dtype else "",
    )


def _parts(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_FINGERPRINT_PARTS:
        raise SnapshotError("metadata field fingerprint_parts is malformed")
    return {_str(k, "fingerprint_parts"): _str(v, "fingerprint_parts") for k, v in value.items()}
