"""``kvsnap run``: scripted use, one prompt or a JSONL batch, with snapshot resume and save."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from cli import options as o
from cli import ui
from cli.common import guarded, open_session
from kvsnap.config import RUN_SAMPLING


@guarded
@o.session_options(RUN_SAMPLING)
def run(
    prompt: Annotated[str | None, typer.Option(help="The prompt text (raw, no chat template unless --chat).")] = None,
    prompt_file: Annotated[
        Path | None, typer.Option(help="Read the prompt from a file; with --prompt, the file's text comes first.")
    ] = None,
    chat: Annotated[
        bool, typer.Option("--chat", help="Wrap the prompt as a user message in the chat template.")
    ] = False,
    system: Annotated[str | None, typer.Option(help="System message (with --chat).")] = None,
    batch: Annotated[
        Path | None, typer.Option(help="JSONL jobs, one per line; '-' reads stdin. Results: one JSON line each.")
    ] = None,
    resume: o.Resume = None,
    on_mismatch: Annotated[
        str, typer.Option(help="When --resume's snapshot is refused: error (default) or recompute from scratch.")
    ] = "error",
    save: o.Save = None,
    json_out: o.Json = False,
    stop: o.Stop = None,
    *,
    opts: o.SessionOptions,
) -> None:
    """Run one prompt (or a batch), reusing a snapshot's matching prefix and saving the result.

    Prime a document once, then ask many questions over it:

      kvsnap run --prompt-file doc.txt --max-new-tokens 0 --save doc.kv

      kvsnap run --prompt-file doc.txt --prompt "Q: who wrote it? A:" --resume doc.kv --json
    """
    from cli.batch import Job, check_save_target, error_row, parse_jobs, run_job
    from kvsnap.config import ON_MISMATCH, check_choice
    from kvsnap.errors import ConfigError, KvsnapError

    if batch is None and prompt is None and prompt_file is None:
        raise ConfigError("give --prompt, --prompt-file or --batch (see kvsnap run --help)")
    if batch is not None and (prompt is not None or prompt_file is not None):
        raise ConfigError("--batch cannot be combined with --prompt or --prompt-file")
    if batch is not None and (save is not None or chat or system is not None):
        raise ConfigError('with --batch, give "save", "chat" and "system" per job in the JSONL file')
    check_choice("--on-mismatch", on_mismatch, ON_MISMATCH)
    session_config = opts.session_config()
    check_save_target(save)
    if opts.store_session is not None and (opts.store is None or batch is not None):
        raise ConfigError("--store-session needs --store DIR and a single prompt")
    defaults = opts.sampling(stop=tuple(stop or ()))
    if batch is not None:
        lines = sys.stdin if str(batch) == "-" else _open_batch(batch)
    session = open_session(opts, session_config)

    if batch is None:
        job = Job(
            id=None,
            prompt=prompt,
            prompt_file=str(prompt_file) if prompt_file else None,
            chat=chat,
            system=system,
            resume=str(resume) if resume else None,
            save=str(save) if save else None,
        )
        stream = None if json_out else ui.emit
        with ui.prefill_progress() as progress:
            row = run_job(
                session,
                job,
                defaults,
                on_text=stream,
                on_progress=progress,
                on_mismatch=on_mismatch,
                store_session=opts.store_session,
            )
        if row.get("restore_error"):
            ui.note(f"snapshot refused, recomputed from scratch: {row['restore_error']}")
        if json_out:
            row.pop("id")
            ui.print_json(row)
        else:
            if row["text"] and not row["text"].endswith("\n"):
                ui.emit("\n")
            ui.note(_stats_line(row))
        return

    failed = 0
    for item in parse_jobs(lines, defaults):
        if isinstance(item, tuple):
            failed += 1
            ui.print_json(error_row(*item))
            continue
        if item.resume is None and resume is not None:
            item = _with(item, resume=str(resume))
        try:
            row = run_job(session, item, defaults, on_mismatch=on_mismatch)
        except KvsnapError as exc:  # one bad job must not stop the batch
            failed += 1
            row = error_row(item.id, exc)
        ui.print_json(row)
    if failed:
        ui.note(f"{failed} job{'s' if failed != 1 else ''} failed")
        raise typer.Exit(1)


def _open_batch(path: Path):
    from kvsnap.errors import ConfigError

    try:
        return path.open(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read batch file ({exc.strerror})") from None


def _with(job, **changes):
    import dataclasses

    return dataclasses.replace(job, **changes)


def _stats_line(row: dict) -> str:
    parts = [
        f"{row['prompt_tokens']:,} prompt tokens",
        f"{row['hit_tokens']:,} reused ({row['reuse_ratio']:.0%})",
        f"{row['prefill_tokens']:,} prefilled in {row['chunks']} chunks",
    ]
    if row.get("ttft_s") is not None:
        parts.append(f"ttft {row['ttft_s']:.3f} s")
    parts.append(f"{row['new_tokens']} new tokens ({row['stop_reason']})")
    if "saved" in row:
        parts.append(f"saved {row['saved']['path']} ({ui.human_bytes(row['saved']['file_bytes'])})")
    return "[" + ", ".join(parts) + "]"
