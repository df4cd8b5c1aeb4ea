"""Plain values shared by the file format, the store and the engine. No torch, no files.

``KVLayout`` is the shape of one token's KV; ``EncodedBlock`` a block as stored (kept by
sessions so the next save does not encode it again); ``chat_messages`` the one check of a
chat message list, used for snapshot metadata, store sessions and batch rows alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvsnap.hashing import chain_root, checksum

KV_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}  # name -> bytes per element


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one token's KV across the model: ``[layers, 2, kv_heads, head_dim]`` of ``dtype``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "bfloat16" | "float16"

    @property
    def itemsize(self) -> int:
        return KV_DTYPES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.itemsize

    def with_dtype(self, dtype: str) -> KVLayout:
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, dtype)

    def to_json(self) -> dict[str, Any]:
        return {
            "layers": self.num_layers,
            "kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KVLayout:
        """The inverse of ``to_json``; ``KeyError``/``TypeError``/``ValueError`` on anything malformed."""
        if data["dtype"] not in KV_DTYPES:
            raise ValueError(f"unknown KV dtype {data['dtype']!r}")
        return cls(int(data["layers"]), int(data["kv_heads"]), int(data["head_dim"]), data["dtype"])

    def describe(self) -> str:
        return f"{self.num_layers} layers x {self.num_kv_heads} kv heads x {self.head_dim} ({self.dtype})"


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """How a session's KV becomes stored blocks: the chain they hash into (model fingerprint, namespace,
    block size) and how each block is encoded (codec, level, storage dtype)."""

    fingerprint: str
    namespace: str
    block_size: int
    codec: str
    level: int
    storage_dtype: str

    def root(self, block_size: int | None = None) -> bytes:
        """The chain root of this model and namespace, at ``block_size`` (default: this format's)."""
        return chain_root(self.fingerprint, self.namespace, block_size or self.block_size)

    def encodes_like(self, block_size: int, codec: str, storage_dtype: str) -> bool:
        """Blocks made with these settings are byte for byte what this format would write."""
        return (block_size, codec, storage_dtype) == (self.block_size, self.codec, self.storage_dtype)


@dataclass(frozen=True, slots=True)
class EncodedBlock:
    """One block as stored: kept by sessions so the next save does not encode it again."""

    num_tokens: int
    hash: bytes | None  # chained hash; None for a partial tail block
    raw_bytes: int
    stored: bytes | memoryview  # a view of the file it was read from, or fresh bytes
    checksum: str
    origin: Any = field(default=None, compare=False, repr=False)  # (mmap, size) when ``stored`` views a mapped file

    def still_valid(self) -> bool:
        """Whether ``stored`` can still be read and is what it was.

        A view of a file that someone truncated in place would fault (SIGBUS) when touched, so
        the mapped file's size is checked first; then the checksum catches same-size edits.
        """
        if self.origin is not None:
            mm, size = self.origin
            try:
                if mm.closed or mm.size() < size:
                    return False
            except (OSError, ValueError):
                return False
        return checksum(self.stored) == self.checksum


Messages = tuple[dict[str, str], ...]


def chat_messages(value: Any) -> Messages | None | bool:
    """``value`` as a tuple of ``{"role", "content"}`` string dicts; None if absent, False if malformed."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    ):
        return False
    return tuple({"role": m["role"], "content": m["content"]} for m in value)


# A chat that outgrew its context keeps every message; the oldest turns leave the model's view. The view
# is the leading system messages, then the messages after the first ``dropped`` that follow them. Files
# and store sessions record ``dropped`` under this key of their ``extra``, so a resumed chat shows the
# model the same turns (and so matches the same tokens).
DROPPED_MESSAGES = "dropped_messages"


def leading_system(messages: Sequence[dict[str, str]]) -> int:
    """How many messages at the start are system messages (they never leave the view)."""
    n = 0
    while n < len(messages) and messages[n].get("role") == "system":
        n += 1
    return n


def chat_view(messages: Sequence[dict[str, str]], dropped: int) -> list[dict[str, str]]:
    """The messages the model sees when the first ``dropped`` after the system messages are out of view."""
    lead = leading_system(messages)
    return [*messages[:lead], *messages[lead + dropped :]]


def dropped_messages(extra: dict[str, Any], messages: Sequence[dict[str, str]] | None) -> int | None:
    """The number of messages out of view that ``extra`` records (0 when it records none); None when it
    is not a count these ``messages`` can have (the reader refuses such a file, the writer such a save)."""
    value = extra.get(DROPPED_MESSAGES, 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        return None
    if value and (messages is None or value > len(messages) - leading_system(messages)):
        return None
    return value
