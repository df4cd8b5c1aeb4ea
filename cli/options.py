"""Options shared by ``chat`` and ``run`` (model and generation flags)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

MODEL_HELP = "Model: smollm2-135m (default), a model folder, a .gguf file, or a hub id in the local HF cache."

Model = Annotated[str, typer.Option("--model", "-m", help=MODEL_HELP)]
MaxNewTokens = Annotated[int, typer.Option(min=0, help="Most tokens to generate; 0 only primes the cache.")]
Temperature = Annotated[float, typer.Option(min=0.0, help="Sampling temperature; 0 means greedy.")]
TopP = Annotated[float, typer.Option(min=0.0, max=1.0, help="Nucleus sampling mass (1 = off).")]
TopK = Annotated[int, typer.Option(min=0, help="Sample among the k most likely tokens (0 = off).")]
Seed = Annotated[int | None, typer.Option(help="Random seed for reproducible sampling.")]
ChunkSize = Annotated[int, typer.Option(min=1, help="Prefill the uncached suffix in chunks of this many tokens.")]
Device = Annotated[str, typer.Option(help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps.")]
Dtype = Annotated[str, typer.Option(help="auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16 or float16.")]
BlockSize = Annotated[int, typer.Option(min=1, help="Tokens per snapshot block (the unit of hashing and storage).")]
Codec = Annotated[
    str,
    typer.Option(
        help="Snapshot codec: shuffle-zstd (default, lossless), zstd, raw, or int8-zstd (lossy, about a quarter "
        "of the raw size; named in the file)."
    ),
]
Stop = Annotated[list[str] | None, typer.Option("--stop", help="Stop generating at this string (repeatable).")]
Resume = Annotated[Path | None, typer.Option(help="Snapshot (.kv) to reuse as the prefix cache.")]
Save = Annotated[Path | None, typer.Option(help="Write the session to this .kv file after the run.")]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object (one line per job in a batch).")]
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
