"""Options shared by commands: declared once here, defaults from ``kvsnap.config``.

``chat`` and ``run`` take the same model, generation, session and store flags; ``session_options``
adds them to a command and hands them over as one ``SessionOptions`` value.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Any

import typer

from kvsnap import config
from kvsnap.config import SamplingParams
from kvsnap_cli.option_help import (
    ADVANCED,
    GENERATION,
    MODEL,
    OUTPUT,
    PANELS,
    SNAPSHOT,
    STORE,
    HelpAll,
    default_said,
    folded,
    model_default,
    panel,
)

MODEL_HELP = (
    f"Model: {config.DEFAULT_MODEL} (default), a folder, a .gguf file, or a hub name: org/name or org/name:FILE.gguf."
)

# Each description fits one line of an 80-column --help; docs/ says the rest.
Model = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        metavar="NAME",
        help=f"{config.DEFAULT_MODEL} (default), a folder, .gguf, org/name.",
        show_default=False,
        rich_help_panel=MODEL,
    ),
]


def within(low: float, high: float | None = None) -> Callable[[Any], Any]:
    """A range check that, unlike typer's ``min``/``max``, leaves the range out of --help's type column."""

    def check(value: Any) -> Any:
        if value is not None and (value < low or (high is not None and value > high)):
            bound = f"between {low:g} and {high:g}" if high is not None else f"at least {low:g}"
            raise typer.BadParameter(f"{value} is not {bound}")
        return value

    return check


MaxNewTokens = Annotated[
    int,
    typer.Option(callback=within(0), metavar="N", help="Most new tokens, 0: only prime.", rich_help_panel=GENERATION),
]
Temperature = Annotated[
    float,
    typer.Option(callback=within(0), metavar="T", help="0 is greedy.", rich_help_panel=GENERATION),
]
TopP = Annotated[float, typer.Option(callback=within(0, 1), metavar="P", help="1 is off.", rich_help_panel=GENERATION)]
TopK = Annotated[
    int,
    typer.Option(callback=within(0), metavar="K", help="0 is off.", rich_help_panel=GENERATION),
]
Seed = Annotated[int | None, typer.Option(metavar="N", help="Random seed for sampling.", rich_help_panel=GENERATION)]
ChunkSize = Annotated[
    int,
    typer.Option(
        callback=within(1),
        metavar="N",
        help="Prefill what is not reused in chunks of N tokens.",
        rich_help_panel=ADVANCED,
    ),
]
CtxSize = Annotated[
    int | None,
    typer.Option(
        callback=within(1),
        metavar="N",
        help="Most tokens a session holds, prompt and answer (default: the model's context); chat, serve and "
        "run --batch reserve that much KV memory up front.",
        rich_help_panel=ADVANCED,
    ),
]
Device = Annotated[
    str,
    typer.Option(
        metavar="DEV", help="auto (default), cpu, cuda, cuda:N or mps.", show_default=False, rich_help_panel=MODEL
    ),
]
Dtype = Annotated[
    str,
    typer.Option(
        metavar="TYPE",
        help="auto (default), float32, bfloat16 or float16.",
        show_default=False,
        rich_help_panel=MODEL,
    ),
]
Quantize = Annotated[
    str,
    typer.Option(
        metavar="Q",
        help="Weights: auto, none, int8, int4.",
        show_default=False,
        rich_help_panel=MODEL,
    ),
]
BlockSize = Annotated[
    int,
    typer.Option(
        callback=within(1),
        metavar="N",
        help="Tokens per block (the unit of hashing and storage).",
        rich_help_panel=ADVANCED,
    ),
]
Codec = Annotated[
    str,
    typer.Option(
        metavar="NAME",
        help="Snapshot codec: shuffle-zstd (lossless), zstd, raw, or int8-zstd (lossy, named in the file).",
        rich_help_panel=ADVANCED,
    ),
]
Reuse = Annotated[
    str,
    typer.Option(
        metavar="HOW",
        help="A stored prefix: load, recompute, or auto: load where measured faster (per machine, model and "
        "dtype; `kvsnap calibrate` measures again).",
        rich_help_panel=ADVANCED,
    ),
]
Verify = Annotated[
    bool | None,
    typer.Option(
        "--verify/--no-verify",
        help="After a restore, recompute the last restored block and compare; past the dtype's tolerance the "
        "reuse is refused (--on-mismatch). Default: when other versions or another device made the KV.",
        show_default=False,
        rich_help_panel=ADVANCED,
    ),
]
Encrypt = Annotated[
    bool,
    typer.Option(
        "--encrypt",
        metavar="",
        help="Encrypt saves with $KVSNAP_KEY_FILE.",
        rich_help_panel=SNAPSHOT,
    ),
]
Explain = Annotated[
    bool,
    typer.Option("--explain", metavar="", help="Say where reuse stopped, and why.", rich_help_panel=OUTPUT),
]
Stop = Annotated[
    list[str] | None,
    typer.Option("--stop", metavar="TEXT", help="Stop at this text (repeatable).", rich_help_panel=GENERATION),
]
Resume = Annotated[
    Path | None, typer.Option(metavar="FILE", help="Snapshot to reuse as the prefix cache.", rich_help_panel=SNAPSHOT)
]
Exact = Annotated[
    bool,
    typer.Option(
        "--exact",
        metavar="",
        help="Batch-invariant forwards: a resumed run is a cold run bit for bit, in bfloat16 too (slower).",
        rich_help_panel=ADVANCED,
    ),
]
ResumeIfExists = Annotated[
    bool,
    typer.Option(
        "--resume-if-exists", metavar="", help="A missing --resume file: a cold run.", rich_help_panel=SNAPSHOT
    ),
]
Save = Annotated[
    Path | None, typer.Option(metavar="FILE", help="Save the session here after the run.", rich_help_panel=SNAPSHOT)
]
Json = Annotated[
    bool,
    typer.Option("--json", metavar="", help="Print one JSON object (a line per job).", rich_help_panel=OUTPUT),
]
Namespace = Annotated[
    str,
    typer.Option(
        metavar="TEXT",
        help="Salt for the hash chain; snapshots of another never match. One per user on shared machines (a hit "
        "is faster than a miss, so shared blocks leak what others asked).",
        rich_help_panel=ADVANCED,
    ),
]
Store = Annotated[
    Path | None,
    typer.Option(
        envvar="KVSNAP_STORE",
        show_envvar=False,
        metavar="DIR",
        help="Block store to use (env KVSNAP_STORE).",
        rich_help_panel=STORE,
    ),
]
StoreBudget = Annotated[
    str | None,
    typer.Option(metavar="SIZE", help="Disk budget for the store (200MB, 2GB).", rich_help_panel=STORE),
]
StoreSession = Annotated[
    str | None,
    typer.Option(metavar="NAME", help="Record the session in the store as NAME.", rich_help_panel=STORE),
]
KvDtype = Annotated[
    str | None,
    typer.Option(
        metavar="TYPE",
        help="Store the KV in .kv files as float16 or bfloat16 (lossy, named in the file).",
        rich_help_panel=ADVANCED,
    ),
]


@dataclass(frozen=True, slots=True)
class SessionOptions:
    """The flags ``chat`` and ``run`` share, as given."""

    model: str
    device: str
    dtype: str
    quantize: str
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
    exact: bool
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
        """The session flags, checked before any model is loaded (``ConfigError``); sealed saves with
        --encrypt or when ``resume`` is sealed."""
        from kvsnap.format import sealed
        from kvsnap.sealing import key_from_env

        key = None
        if self.encrypt or (resume is not None and sealed.is_sealed(resume)):
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
            exact=self.exact,
            key=key,
        )
        return cfg.check(with_store=self.store is not None)


def _shared(sampling: SamplingParams, model_defaults: bool) -> list[tuple[str, Any, Any]]:
    """(name, annotation, default) of every shared flag, in the order ``--help`` lists them."""
    if model_defaults:
        temperature = ("temperature", model_default(Temperature, sampling.temperature), None)
        top_p = ("top_p", model_default(TopP, sampling.top_p), None)
        top_k = ("top_k", model_default(TopK, sampling.top_k), None)
    else:
        temperature = ("temperature", default_said(Temperature, f"{sampling.temperature:g}"), sampling.temperature)
        top_p = ("top_p", default_said(TopP, f"{sampling.top_p:g}"), sampling.top_p)
        top_k = ("top_k", default_said(TopK, sampling.top_k), sampling.top_k)
    return [
        ("model", Model, config.DEFAULT_MODEL),
        ("device", Device, config.DEFAULT_DEVICE),
        ("dtype", Dtype, config.DEFAULT_DTYPE),
        ("quantize", default_said(Quantize, config.DEFAULT_QUANTIZE), config.DEFAULT_QUANTIZE),
        ("max_new_tokens", default_said(MaxNewTokens, sampling.max_new_tokens), sampling.max_new_tokens),
        temperature,
        top_p,
        top_k,
        ("seed", Seed, None),
        ("store", Store, None),
        ("store_session", StoreSession, None),
        ("store_budget", StoreBudget, None),
        ("explain", Explain, False),
        ("verify", Verify, None),
        ("reuse", Reuse, "auto"),
        ("chunk_size", ChunkSize, config.DEFAULT_CHUNK_SIZE),
        ("ctx_size", CtxSize, None),
        ("namespace", Namespace, ""),
        ("exact", Exact, False),
        ("encrypt", Encrypt, False),
        ("block_size", BlockSize, config.DEFAULT_BLOCK_SIZE),
        ("codec", Codec, config.DEFAULT_CODEC),
        ("kv_dtype", KvDtype, None),
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
        added = [
            inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, annotation=folded(a), default=d) for n, a, d in shared
        ]

        @functools.wraps(fn)
        def wrapper(**kwargs: Any) -> Any:
            kwargs.pop("help_all", None)
            opts = SessionOptions(**{name: kwargs.pop(name) for name in names}, defaults=sampling)
            return fn(**kwargs, opts=opts)

        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
        # --help shows the panels in the order their first option comes: by PANELS, whoever declares them.
        ranked = sorted(own + added, key=lambda p: PANELS.index(panel(p.annotation) or ADVANCED))
        ranked.append(inspect.Parameter("help_all", inspect.Parameter.KEYWORD_ONLY, annotation=HelpAll, default=False))
        wrapper.__signature__ = sig.replace(parameters=ranked)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in ranked}
        del wrapper.__wrapped__  # typer must read the new signature, not the command's own
        return wrapper

    return decorate
