"""``kvsnap inspect``: what a snapshot holds and what a prompt would reuse (no model, no torch)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvsnap.config import DEFAULT_CHUNK_SIZE
from kvsnap_cli import ui
from kvsnap_cli.common import guarded
from kvsnap_cli.options import Json


@guarded
def inspect(
    file: Annotated[Path, typer.Argument(help="The .kv snapshot to inspect.")],
    prompt: Annotated[str | None, typer.Option(help="Show what this raw prompt would reuse.")] = None,
    prompt_file: Annotated[Path | None, typer.Option(help="Read the prompt from a file (then --prompt).")] = None,
    chunk_size: Annotated[int, typer.Option(min=1, help="Chunk size for the suffix plan.")] = DEFAULT_CHUNK_SIZE,
    run_model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            help="With a prompt: also check that this model (and --namespace) would key its KV as the file does, "
            "and say which fingerprint part differs if not (reads its folder; no model is loaded).",
        ),
    ] = None,
    namespace: Annotated[str, typer.Option(help="The namespace a run would use (with --model).")] = "",
    verify: Annotated[
        bool, typer.Option("--verify", metavar="", help="Check every block's checksum and decoding.")
    ] = False,
    json_out: Json = False,
) -> None:
    """Show a snapshot: model, tokens, blocks, sizes, codec, chat turns, the versions that made it; with a
    prompt, its hit stats and where and why reuse stops (the first differing token, the text around it, a likely
    cause)."""
    from kvsnap.engine import describe
    from kvsnap.errors import ConfigError, SnapshotKeyError
    from kvsnap.format.reader import Snapshot
    from kvsnap.format.sealed import clear_facts
    from kvsnap.models.locate import locate_tokenizer
    from kvsnap_cli.batch import check_text, read_prompt_file

    check_text("--prompt", prompt)
    check_text("--namespace", namespace)
    try:
        with Snapshot(file) as snap:
            model = snap.meta.model
            hint = snap.meta.extra.get("model_folder")
    except SnapshotKeyError as exc:
        if prompt is not None or prompt_file is not None or verify:
            raise
        # Without its key, what is not secret: the format, the key's id, the sizes.
        facts = clear_facts(file)
        if json_out:
            ui.print_json(facts)
        else:
            ui.print_sealed(facts)
        ui.note(str(exc).removeprefix(f"{file}: "))
        return
    tokenizer, why = locate_tokenizer(model, hint if isinstance(hint, str) else None)
    prompt_ids = None
    if prompt is not None or prompt_file is not None:
        if why is not None:
            raise ConfigError(f"{why}; the prompt cannot be tokenized without it")
        if tokenizer is None:
            raise ConfigError(f"the tokenizer of {model} is not on this machine (run: kvsnap pull {model})")
        text = (read_prompt_file(str(prompt_file)) if prompt_file else "") + (prompt or "")
        prompt_ids = tokenizer.encode(text)
    running = None
    if run_model is not None and prompt_ids is not None:
        from kvsnap.engine.explain import running_model

        running = running_model(run_model, namespace)
        if running is None:
            raise ConfigError(f"model {run_model} is not on this machine (run: kvsnap pull {run_model})")
    info = describe.describe(
        file, prompt_ids=prompt_ids, chunk_size=chunk_size, verify=verify, tokenizer=tokenizer, running=running
    )
    if why is not None:
        info["no_preview"] = f"{why}; no text preview"
    if json_out:
        ui.print_json(info)
    else:
        ui.print_inspect(info)
    if verify and not info["verified"]:
        raise typer.Exit(1)
