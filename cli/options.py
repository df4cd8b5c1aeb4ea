"""Options shared by commands: declared once here, defaults from ``kvsnap.config``.

``chat`` and ``run`` take the same model, generation, session and store flags; ``session_options``
adds them to a command and hands them over as one ``SessionOptions`` value.
"""

from __future__ import annotations

import copy
import functools
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Any

import typer

from kvsnap import config
from kvsnap.config import SamplingParams
from kvsnap.errors import ConfigError

MODEL_HELP = (
    f"Model: {config.DEFAULT_MODEL} (default), a model folder, a .gguf file, or a hub id in the local HF cache."
)

Model = Annotated[str, typer.Option("--model", "-m", help=MODEL_HELP)]
MaxNewTokens = Annotated[int, typer.Option(min=0, help="Most tokens to generate; 0 only primes the cache.")]
Temperature = Annotated[float, typer.Option(min=0.0, help="Sampling temperature; 0 means greedy.")]
TopP = Annotated[float, typer.Option(min=0.0, max=1.0, help="Nucleus sampling mass (1 = off).")]
TopK = Annotated[int, typer.Option(min=0, help="Sample among the k most likely tokens (0 = off).")]
Seed = Annotated[int | None, typer.Option(help="Random seed for reproducible sampling.")]
ChunkSize = Annotated[int, typer.Option(min=1, help="Prefill the uncached suffix in chunks of this many tokens.")]
CtxSize = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="Most tokens a session holds, prompt and answer (default: the model's context). A longer prompt "
        "is refused and generation stops there; chat, serve and run --batch reserve that much KV memory "
        "up front on the CPU.",
    ),
]
Device = Annotated[str, typer.Option(help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps.")]
Dtype = Annotated[
    str,
    typer.Option(
        help="auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16 or float16. On a CPU with AMX or "
        "AVX512-BF16, bfloat16 resumes and decodes faster (docs/benchmarks.md); its snapshots are another "
        "model's KV (a float32 session refuses them)."
    ),
]
BlockSize = Annotated[int, typer.Option(min=1, help="Tokens per snapshot block (the unit of hashing and storage).")]
Codec = Annotated[
    str,
    typer.Option(
        help="Snapshot codec: shuffle-zstd (default, lossless), zstd, raw, or int8-zstd (lossy, about a quarter "
        "of the raw size; named in the file)."
    ),
]
Reuse = Annotated[
    str,
    typer.Option(
        help="A stored prefix (--resume, --store): load it, recompute it, or auto: load only where loading is "
        "measured faster on this machine (calibrated once; `kvsnap calibrate` measures again).",
    ),
]
Verify = Annotated[
    bool | None,
    typer.Option(
        "--verify/--no-verify",
        help="After a restore, recompute the last restored block and compare its K/V and next-token logits "
        "with the restored ones; beyond the dtype's tolerance the reuse is refused (--on-mismatch). "
        "Default: only when the versions or device that made the KV differ from these (one block's prefill).",
        show_default=False,
    ),
]
Encrypt = Annotated[
    bool,
    typer.Option(
        help="Encrypt saved snapshots (AES-256-GCM) with the key in the file $KVSNAP_KEY_FILE names (0600; "
        "`kvsnap keygen FILE` makes one). A snapshot resumed encrypted is saved encrypted anyway.",
    ),
]
Explain = Annotated[
    bool,
    typer.Option(
        "--explain",
        metavar="",
        help="Say where reuse stopped and why (the JSON ledger's `miss`): the first differing token, the text "
        "around it, and a likely cause (system message, chat template, tokenization, model, namespace).",
    ),
]
Stop = Annotated[list[str] | None, typer.Option("--stop", help="Stop generating at this string (repeatable).")]
Resume = Annotated[Path | None, typer.Option(help="Snapshot (.kv) to reuse as the prefix cache.")]
ResumeIfExists = Annotated[
    bool,
    typer.Option(
        "--resume-if-exists",
        metavar="",
        help="A missing --resume file (or a batch job's) means a cold run with a note, not an error, as in "
        "chat: scripts can resume and save the same file from the first run on.",
    ),
]
Save = Annotated[Path | None, typer.Option(help="Write the session to this .kv file after the run.")]
Json = Annotated[bool, typer.Option("--json", metavar="", help="Print one JSON object (one line per job in a batch).")]
Namespace = Annotated[
    str,
    typer.Option(
        help="Salt for the block hash chain: snapshots made under another namespace never match. "
        "Use one per user on shared machines (a hit is faster than a miss, so shared blocks leak what others asked)."
    ),
]
Store = Annotated[
    Path | None,
    typer.Option(
        envvar="KVSNAP_STORE",
        help="Block store folder shared by runs and chats: the longest prefix found there is reused, "
        "and new blocks are added after each request (env KVSNAP_STORE).",
    ),
]
StoreBudget = Annotated[
    str | None, typer.Option(help="Disk budget for --store (200MB, 2GB or bytes); least recently used leaves go first.")
]
StoreSession = Annotated[
    str | None,
    typer.Option(help="With --store: record the session under this name (for kvsnap store pin/export)."),
]
KvDtype = Annotated[
    str | None,
    typer.Option(
        help="Store the KV in .kv files as float16 or bfloat16 (half the bytes of a float32 cache; lossy, "
        "named in the file, never the default)."
    ),
]


@dataclass(frozen=True, slots=True)
class SessionOptions:
    """The flags ``chat`` and ``run`` share, as given."""

    model: str
    device: str
    dtype: str
    max_new_tokens: int
    temperature: float | None  # None: the model's recommendation, else ``defaults``
    top_p: float | None
    top_k: int | None
    seed: int | None
    chunk_size: int
    ctx_size: int | None
    block_size: int
    codec: str
    kv_dtype: str | None
    reuse: str
    namespace: str
    store: Path | None
    store_budget: str | None
    store_session: str | None
    verify: bool | None
    explain: bool
    encrypt: bool

    defaults: SamplingParams = config.RUN_SAMPLING  # what an unset sampling flag falls back to

    def sampling(self, stop: tuple[str, ...] = (), model_defaults: dict[str, Any] | None = None) -> SamplingParams:
        """The generation flags, checked (``ConfigError``). An unset temperature, top-p or top-k takes
        the model's recommendation (``model_defaults``, from its generation_config.json), else ours."""
        chosen = {}
        for key in ("temperature", "top_p", "top_k"):
            value = getattr(self, key)
            if value is None:
                value = (model_defaults or {}).get(key, getattr(self.defaults, key))
            chosen[key] = value
        return SamplingParams(max_new_tokens=self.max_new_tokens, seed=self.seed, stop=stop, **chosen)

    def session_config(self, resume: Path | None = None) -> config.SessionConfig:
        """The session flags, checked before any model is loaded (``ConfigError``). Saves are sealed
        with --encrypt, or when ``resume`` is an encrypted snapshot (its conversation stays sealed)."""
        key = None
        if self.encrypt or (resume is not None and is_sealed(resume)):
            from kvsnap.sealing import key_from_env

            key = key_from_env(required="--encrypt" if self.encrypt else f"resuming the encrypted {resume}")
        cfg = config.SessionConfig(
            block_size=self.block_size,
            chunk_size=self.chunk_size,
            namespace=self.namespace,
            codec=self.codec,
            kv_dtype=self.kv_dtype,
            reuse=self.reuse,
            verify=self.verify,
            explain=self.explain,
            key=key,
        )
        return cfg.check(with_store=self.store is not None)


def _model_default(flag: Any, fallback: float) -> Any:
    """``flag`` made optional: unset means the model's generation_config.json value, else ``fallback``."""
    base, info = flag.__origin__, flag.__metadata__[0]
    info = copy.copy(info)
    info.help = f"{info.help} Default: the model's generation_config.json, else {fallback:g}."
    return Annotated[base | None, info]


def _shared(sampling: SamplingParams, model_defaults: bool) -> list[tuple[str, Any, Any]]:
    """(name, annotation, default) of every shared flag, in the order ``--help`` lists them."""
    if model_defaults:
        temperature = ("temperature", _model_default(Temperature, sampling.temperature), None)
        top_p = ("top_p", _model_default(TopP, sampling.top_p), None)
        top_k = ("top_k", _model_default(TopK, sampling.top_k), None)
    else:
        temperature = ("temperature", Temperature, sampling.temperature)
        top_p = ("top_p", TopP, sampling.top_p)
        top_k = ("top_k", TopK, sampling.top_k)
    return [
        ("model", Model, config.DEFAULT_MODEL),
        ("max_new_tokens", MaxNewTokens, sampling.max_new_tokens),
        temperature,
        top_p,
        top_k,
        ("seed", Seed, None),
        ("chunk_size", ChunkSize, config.DEFAULT_CHUNK_SIZE),
        ("ctx_size", CtxSize, None),
        ("namespace", Namespace, ""),
        ("store", Store, None),
        ("store_budget", StoreBudget, None),
        ("store_session", StoreSession, None),
        ("verify", Verify, None),
        ("explain", Explain, False),
        ("encrypt", Encrypt, False),
        ("block_size", BlockSize, config.DEFAULT_BLOCK_SIZE),
        ("codec", Codec, config.DEFAULT_CODEC),
        ("kv_dtype", KvDtype, None),
        ("reuse", Reuse, "auto"),
        ("device", Device, config.DEFAULT_DEVICE),
        ("dtype", Dtype, config.DEFAULT_DTYPE),
    ]


def session_options(
    sampling: SamplingParams, *, model_defaults: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add the shared flags to a command (generation defaults from ``sampling``; with ``model_defaults``
    an unset temperature/top-p/top-k takes the model's own recommendation first); the command gets them
    as ``opts: SessionOptions`` instead of one parameter each."""
    shared = _shared(sampling, model_defaults)
    names = {name for name, _, _ in shared}
    assert names == {f.name for f in fields(SessionOptions)} - {"defaults"}

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn, eval_str=True)
        own = [p for p in sig.parameters.values() if p.name != "opts"]
        added = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, annotation=a, default=d) for n, a, d in shared]

        @functools.wraps(fn)
        def wrapper(**kwargs: Any) -> Any:
            opts = SessionOptions(**{name: kwargs.pop(name) for name in names}, defaults=sampling)
            return fn(**kwargs, opts=opts)

        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
        wrapper.__signature__ = sig.replace(parameters=own + added)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in own + added}
        del wrapper.__wrapped__  # typer must read the new signature, not the command's own
        return wrapper

    return decorate


_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_size(value: str | int) -> int:
    """``"200MB"``, ``"2GB"``, ``"1.5GiB"`` or a plain byte count -> bytes; ``ConfigError`` otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ConfigError(f"size {value} is negative")
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*", str(value), flags=re.IGNORECASE)
    if m is None:
        raise ConfigError(f"cannot read {value!r} as a size (examples: 200MB, 2GB, 1048576)")
    number, unit, binary = m.groups()
    scale = 1024 ** "kmgt".index(unit.lower()) * 1024 if binary and unit else _UNITS[unit.lower()]
    return int(float(number) * scale)


def is_sealed(path: Path) -> bool:
    """Whether ``path`` is an encrypted snapshot (False for anything else, a missing file included)."""
    from kvsnap.errors import KvsnapError
    from kvsnap.format.sealed import clear_facts

    try:
        clear_facts(path)
    except (KvsnapError, OSError):
        return False
    return True
