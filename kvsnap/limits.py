"""The bounds of a ``.kv`` file, in one table. No torch, no numpy.

The reader (``format.meta``) refuses a file past any of them, so the writer, ``SessionConfig``
and ``Session`` check the same ones first: what kvsnap writes, it reads. A flag that would break
a bound is refused before any work, with the largest value that fits.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from kvsnap.errors import ConfigError

if TYPE_CHECKING:
    from kvsnap.types import KVLayout

MAX_TOKENS = 1 << 26  # tokens in one snapshot, and so in one session (it must stay savable)
MAX_LAYOUT_DIM = 1 << 16  # layers, KV heads and head dim, each
MAX_BLOCK_SIZE = 1 << 16  # tokens per block
# Raw KV bytes in one block, whatever the codec's ratio allows, so a few hostile bytes cannot make
# a reader allocate more. A restore holds one decode buffer of a block per thread (up to 8) and a
# save one raw copy plus its encoding per encoder (4): 1 GiB keeps that within 8 GiB, and still
# allows 1,024-token blocks for Llama-2-7B in float32 (1 MiB per token) and 3,276 for Llama-2-70B
# in bfloat16 (320 KiB); a block is the unit of reuse, so useful sizes are far below that.
MAX_BLOCK_BYTES = 1 << 30
MIN_LEVEL, MAX_LEVEL = -(1 << 17), 22  # zstd's compression levels
MAX_HEADER_BYTES = 100_000_000  # safetensors refuses a larger JSON header ("header too large")
MAX_META_STRING = 4096  # the longest model name, fingerprint or checksum the metadata may hold
MAX_FINGERPRINT_PARTS = 16


def size_text(n: int) -> str:
    """``1 GiB``, ``320 KiB``, ``1.5 MiB``: for messages."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n} B"


def max_block_size(bytes_per_token: int) -> int:
    """The largest block size whose blocks fit in ``MAX_BLOCK_BYTES`` (at least 1)."""
    return max(1, min(MAX_BLOCK_SIZE, MAX_BLOCK_BYTES // max(1, bytes_per_token)))


def check_block_size(block_size: int) -> None:
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ConfigError(f"block size must be in [1, {MAX_BLOCK_SIZE:,}], not {block_size:,}")


def check_level(level: int) -> None:
    if not MIN_LEVEL <= level <= MAX_LEVEL:
        raise ConfigError(f"compression level must be in [{MIN_LEVEL:,}, {MAX_LEVEL}], not {level:,}")


def check_layout(layout: KVLayout, block_size: int) -> None:
    """Refuse a cache layout, or a block size for it, that a ``.kv`` file cannot hold.

    ``layout`` is the layout the block bytes are stored in (the cache's, or ``--kv-dtype``'s).
    """
    for name, value in (
        ("layers", layout.num_layers),
        ("kv heads", layout.num_kv_heads),
        ("head dim", layout.head_dim),
    ):
        if not 1 <= value <= MAX_LAYOUT_DIM:
            raise ConfigError(f"the model has {value:,} {name}; a .kv file holds at most {MAX_LAYOUT_DIM:,}")
    per_token = layout.bytes_per_token
    if block_size * per_token > MAX_BLOCK_BYTES:
        raise ConfigError(
            f"block size {block_size:,} makes blocks of {size_text(block_size * per_token)} for this model "
            f"({size_text(per_token)} of KV per token in {layout.dtype}); a block holds at most "
            f"{size_text(MAX_BLOCK_BYTES)}: use a block size of {max_block_size(per_token):,} or less"
        )


def memory_budget() -> int:
    """A process-wide cap for memory kvsnap keeps beyond what a session needs (pooled KV buffers, packed
    weights): a quarter of RAM, at most 4 GiB (1 GiB where RAM cannot be read)."""
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 30
    return min(4 << 30, ram // 4)


MODEL_CONTEXT = "the model's context"
ASKED_CONTEXT = "the context size asked for"  # --ctx-size / load_model(ctx_size=...)
# A RoPE that switches frequencies by the sequence length (longrope, dynamic NTK) keeps the KV exact only
# up to its switch: the context kvsnap runs such a model in.
ROPE_CONTEXT = "the model's context at fixed RoPE frequencies"


def check_tokens(num_tokens: int, context: int | None = None, source: str = MODEL_CONTEXT) -> None:
    """Refuse a prompt longer than the context (``context`` positions, set by ``source``) or than a snapshot holds."""
    limit, what = token_limit(context, source)
    if num_tokens > limit:
        raise ConfigError(f"the prompt is {num_tokens:,} tokens, more than {what} ({limit:,})")


def token_limit(context: int | None, source: str = MODEL_CONTEXT) -> tuple[int, str]:
    """The most tokens a session may hold (prompt and answer), and what sets it."""
    if context is not None and context <= MAX_TOKENS:
        return context, source
    return MAX_TOKENS, "a snapshot holds"


def check_ctx_size(ctx_size: int, model_context: int | None) -> int:
    """A context size asked for (``--ctx-size``), checked against the model's and a snapshot's limits."""
    if isinstance(ctx_size, bool) or not isinstance(ctx_size, int) or ctx_size < 1:
        raise ConfigError(f"the context size must be a positive number of tokens, not {ctx_size!r}")
    limit, what = token_limit(model_context)
    if ctx_size > limit:
        raise ConfigError(f"a context of {ctx_size:,} tokens is more than {what} ({limit:,})")
    return ctx_size
