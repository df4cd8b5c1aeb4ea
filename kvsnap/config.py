"""Every default a user can change, and its check, in one place. No torch.

The CLI takes its defaults from here (so ``--help`` and the Python API agree) and checks every
setting before it loads a model: a bad flag costs milliseconds, not a model load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvsnap import limits
from kvsnap.errors import ConfigError

if TYPE_CHECKING:
    from kvsnap.sealing import SealKey
    from kvsnap.types import KVLayout

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_BLOCK_SIZE = 64  # tokens per block: the unit of hashing, storage and reuse
DEFAULT_CHUNK_SIZE = 512  # tokens per prefill forward
CODECS = ("shuffle-zstd", "zstd", "raw")  # lossless: decode gives back the exact bytes (kvsnap.format.codec)
LOSSY_CODECS = ("int8-zstd",)  # opt-in, never the default: named in the file
ALL_CODECS = CODECS + LOSSY_CODECS
DEFAULT_CODEC = "shuffle-zstd"
DEFAULT_LEVEL = 1  # zstd level: 1 compresses float KV within 1% of level 3, several times faster
DEFAULT_DEVICE = "auto"
DEFAULT_DTYPE = "auto"
# A GGUF runs at its own precision (Q4 files in int4, Q8 in int8: kvsnap.models.quantize), as llama.cpp runs
# it; any other folder's weights run as it holds them. Figures behind the choice: docs/models.md.
DEFAULT_QUANTIZE = "auto"
ON_MISMATCH = ("error", "recompute")  # what to do when a --resume snapshot is refused
# A chat turn whose prompt and answer room do not fit the context: drop the oldest turns from the model's
# view (the messages keep them; kvsnap.engine.chat_view), or refuse the turn.
ON_CONTEXT_FULL = ("drop_oldest", "error")
MIN_TEMPERATURE = 1e-5  # sampling below this temperature is greedy (SamplingParams.greedy)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` are off."""

    max_new_tokens: int = 256
    temperature: float = 0.7
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_loops: bool = True  # end an answer stuck repeating one short sequence (stop_reason "repetition")

    def __post_init__(self) -> None:
        # A bound even where a model states no context (where it does, generation stops there first).
        if not 0 <= self.max_new_tokens <= limits.MAX_TOKENS:
            raise ConfigError(f"max_new_tokens must be in [0, {limits.MAX_TOKENS:,}]")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError("temperature must be a finite number >= 0")
        if self.top_k < 0:
            raise ConfigError("top_k must be >= 0")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ConfigError("top_p must be in (0, 1]")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ConfigError("seed must be in [0, 2**63)")

    @property
    def greedy(self) -> bool:
        # Below the floor, logits / temperature overflow float32 (inf, then NaN probabilities); so
        # close to 0 the answer is the greedy one anyway (vLLM draws the same line).
        return self.temperature < MIN_TEMPERATURE


# `kvsnap run` is for scripts: greedy by default, so the same prompt gives the same answer.
RUN_SAMPLING = SamplingParams(max_new_tokens=256, temperature=0.0, top_p=1.0, top_k=0)
# Chosen by benchmarks/chat_quality.py (factual questions over many seeds, SmolLM2-135M): more correct
# answers at temperature 0.2 / top-p 0.9 than at 0.7 / 0.95 (docs/benchmarks.md). A model's own
# generation_config.json recommendation comes first.
CHAT_SAMPLING = SamplingParams(max_new_tokens=512, temperature=0.2, top_p=0.9, top_k=0)


def check_codec(codec: str) -> None:
    """Refuse an unknown snapshot codec."""
    if codec not in ALL_CODECS:
        raise ConfigError(f"unknown codec {codec!r} (known: {', '.join(ALL_CODECS)})")


def check_choice(flag: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{flag} must be {', '.join(allowed[:-1])} or {allowed[-1]}, not {value!r}")


@dataclass(frozen=True, slots=True)
class SessionConfig:
    """How a session keys, prefills and stores its KV. ``check()`` refuses what cannot work."""

    block_size: int = DEFAULT_BLOCK_SIZE
    chunk_size: int = DEFAULT_CHUNK_SIZE
    namespace: str = ""
    codec: str = DEFAULT_CODEC
    level: int = DEFAULT_LEVEL
    kv_dtype: str | None = None  # narrower storage of the KV in .kv files (lossy); None: the cache's dtype
    reuse: str = "auto"  # load a stored prefix, recompute it, or decide by measured cost (kvsnap.reuse)
    # Recompute one restored block and compare (kvsnap.engine.verify): True always, False never, None
    # only when the versions or device that made the KV differ from the running ones.
    verify: bool | None = None
    explain: bool = False  # say where reuse stopped and why (TurnResult.miss)
    # A refused snapshot or a failed verify: "error" raises, "recompute" runs the prompt cold and says why.
    on_mismatch: str = "error"
    on_context_full: str = "drop_oldest"  # Session.chat only; see ON_CONTEXT_FULL
    # A batch-invariant forward (kvsnap.models.exact): a token's KV does not depend on how the prompt was
    # cut into chunks, so a resumed run equals a cold one bit for bit in bfloat16 too. Costs prefill and
    # decode time (benchmarks/exact.py); the native forward only.
    exact: bool = False
    key: SealKey | None = None  # seals the .kv files this session saves (kvsnap.format.sealed)

    def check(self, *, with_store: bool = False) -> SessionConfig:
        """Raise ``ConfigError`` for a setting that cannot work; returns self."""
        from kvsnap.types import KV_DTYPES

        # The bounds a .kv file's reader enforces are refused here, not after a run at save time.
        limits.check_block_size(self.block_size)
        if self.chunk_size < 1:
            raise ConfigError("chunk_size must be >= 1")
        check_codec(self.codec)
        from kvsnap.reuse import check_reuse

        check_reuse(self.reuse)
        limits.check_level(self.level)
        check_choice("on_mismatch", self.on_mismatch, ON_MISMATCH)
        check_choice("on_context_full", self.on_context_full, ON_CONTEXT_FULL)
        if self.verify not in (True, False, None) or self.explain not in (True, False):
            raise ConfigError("verify must be True, False or None (automatic), and explain True or False")
        if self.exact not in (True, False):
            raise ConfigError("exact must be True or False")
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"unknown KV storage dtype {self.kv_dtype!r} (known: {', '.join(KV_DTYPES)})")
        if with_store and self.codec in LOSSY_CODECS:
            raise ConfigError("a lossy codec is for .kv files; blocks in the store are shared and kept exact")
        return self

    def check_layout(self, layout: KVLayout) -> SessionConfig:
        """Refuse, once the model's cache layout is known (before its weights load), blocks larger than
        a ``.kv`` file may hold: ``block_size`` tokens of KV in the stored dtype. Returns self."""
        limits.check_layout(layout.with_dtype(self.kv_dtype or layout.dtype), self.block_size)
        return self
