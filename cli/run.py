"""``kvsnap run``: scripted use, one prompt or a JSONL batch, with snapshot resume and save."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from kvsnap.config import RUN_SAMPLING
from kvsnap_cli import options as o
from kvsnap_cli import startup, ui
from kvsnap_cli.common import guarded, open_session

INPUT = "Input"


@guarded
@o.session_options(RUN_SAMPLING)
def run(
    prompt: Annotated[
        str | None, typer.Option(metavar="TEXT", help="The prompt (raw text unless --chat).", rich_help_panel=INPUT)
    ] = None,
    prompt_file: Annotated[
        Path | None,
        typer.Option(metavar="FILE", help="Read the prompt from a file (before --prompt).", rich_help_panel=INPUT),
    ] = None,
    chat: Annotated[
        bool,
        typer.Option("--chat", metavar="", help="Wrap the prompt in the chat template.", rich_help_panel=INPUT),
    ] = False,
    system: Annotated[
        str | None, typer.Option(metavar="TEXT", help="System message (with --chat).", rich_help_panel=INPUT)
    ] = None,
    batch: Annotated[
        Path | None,
        typer.Option(metavar="FILE", help="JSONL jobs, one per line ('-': stdin).", rich_help_panel=INPUT),
    ] = None,
    resume: o.Resume = None,
    resume_if_exists: o.ResumeIfExists = False,
    on_mismatch: Annotated[
        str,
        typer.Option(
            metavar="HOW",
            help="When --resume's snapshot is refused, or reused KV fails the --verify check: error (default) "
            "or recompute from scratch.",
            rich_help_panel=o.ADVANCED,
            hidden=True,
        ),
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

      kvsnap run --prompt-file doc.txt --prompt $'\\nQ: Who wrote it?\\nA:' \\
          --resume doc.kv --stop $'\\n'

    The prompt is raw text: special-token text in it (<|im_end|>) is the control token. With --chat,
    --system or a job's "messages", special-token text is kept as plain text.
    """
    startup.stamp("command")
    import dataclasses

    from kvsnap.config import ON_MISMATCH, check_choice
    from kvsnap.errors import ConfigError
    from kvsnap.paths import open_regular
    from kvsnap_cli.batch import check_save_target, check_text

    if batch is None and prompt is None and prompt_file is None:
        raise ConfigError("give --prompt, --prompt-file or --batch (see kvsnap run --help)")
    if batch is not None and (prompt is not None or prompt_file is not None):
        raise ConfigError("--batch cannot be combined with --prompt or --prompt-file")
    if batch is not None and (save is not None or chat or system is not None):
        raise ConfigError('with --batch, give "save", "chat" and "system" per job in the JSONL file')
    check_choice("--on-mismatch", on_mismatch, ON_MISMATCH)
    if resume_if_exists and resume is None and batch is None:
        raise ConfigError('--resume-if-exists needs --resume FILE (or --batch jobs with "resume")')
    session_config = dataclasses.replace(opts.session_config(resume), on_mismatch=on_mismatch)
    check_save_target(save)
    for flag, text in (("--prompt", prompt), ("--system", system), ("--namespace", opts.namespace)):
        check_text(flag, text)  # before the model loads, not in the tokenizer after it
    if opts.store_session is not None and (opts.store is None or batch is not None):
        raise ConfigError("--store-session needs --store DIR and a single prompt")
    defaults = opts.sampling(stop=tuple(stop or ()))
    # Files that are not there are reported now, before the model loads (seconds), not after it.
    if prompt_file is not None:
        with open_regular(prompt_file, error=ConfigError, what="prompt file"):
            pass
    if resume is not None and batch is None and not resume_if_exists and not resume.exists():
        raise ConfigError(f"{resume}: no such snapshot to resume (--resume-if-exists runs from scratch instead)")
    if batch is not None:
        _run_batch(opts, session_config, defaults, batch, resume, resume_if_exists)
        return
    from kvsnap_cli.batch import Job

    job = Job(
        id=None,
        prompt=prompt,
        prompt_file=str(prompt_file) if prompt_file else None,
        chat=chat,
        system=system,
        resume=str(resume) if resume else None,
        save=str(save) if save else None,
        resume_if_exists=resume_if_exists,
    )
    _run_one(opts, session_config, defaults, job, json_out)


def _run_one(opts: o.SessionOptions, session_config, defaults, job, json_out: bool) -> None:
    """One prompt: its answer streamed (or one JSON object), the ledger on stderr."""
    from kvsnap_cli.batch import run_job

    resume = Path(job.resume) if job.resume is not None else None
    prefetch = resume if resume is not None and resume.exists() else None
    session = open_session(opts, session_config, prefetch=prefetch)
    startup.stamp("session")
    stream = None if json_out else ui.emit
    with ui.prefill_progress() as progress:
        row = run_job(session, job, defaults, on_text=stream, on_progress=progress, store_session=opts.store_session)
    if not json_out and row["text"] and not row["text"].endswith("\n"):
        ui.emit("\n")  # the notes below start on a line of their own, after the streamed answer
    if row.get("resume_missing"):
        ui.note(f"{resume} does not exist yet: ran from scratch")
    if row.get("restore_error"):
        ui.note(f"snapshot refused, recomputed from scratch: {row['restore_error']}")
    if row.get("store_error"):
        ui.note(f"warning: {row['store_error']}")
    if json_out:
        row.pop("id")
        if startup.TIMINGS:  # benchmarks/startup.py
            startup.stamp("done")
            row["timings"] = {
                "stamps": dict(startup.stamps),
                "load": dict(session.lm.load_timings),
                "backend": session.lm.backend,
            }
        ui.print_json(row)
        return
    ui.note(_stats_line(row))
    if row.get("verify"):
        ui.note(ui.verify_line(row))
    for line in ui.miss_lines(row["miss"]) if row.get("miss") else ():
        ui.note(line)


def _run_batch(opts: o.SessionOptions, session_config, defaults, batch: Path, resume, resume_if_exists: bool) -> None:
    """A JSONL batch: one result row per job on stdout; a failing job is an error row, not the end."""
    from kvsnap.errors import KvsnapError
    from kvsnap_cli.batch import check_save_target, error_row, parse_jobs, read_lines, run_job

    # Bytes, line by line: each line is decoded on its own, so one bad line is one error row.
    lines = read_lines(sys.stdin.buffer if str(batch) == "-" else _open_batch(batch))
    # A batch runs many forwards: its weights are packed once (not the chat template's tokenizer in the
    # background, which would only slow the first job: a batch of raw prompts never needs it).
    session = open_session(opts, session_config, workload="batch")
    startup.stamp("session")
    failed = 0
    for item in parse_jobs(lines, defaults):
        if isinstance(item, tuple):
            failed += 1
            ui.print_json(error_row(*item))
            continue
        if item.resume is None and resume is not None:
            item = _with(item, resume=str(resume))
        if resume_if_exists:
            item = _with(item, resume_if_exists=True)
        try:
            check_save_target(item.save)  # a target the save would refuse fails the job before it runs
            row = run_job(session, item, defaults)
        except KvsnapError as exc:  # one bad job must not stop the batch
            failed += 1
            row = error_row(item.id, exc)
        ui.print_json(row)
    if failed:
        ui.note(f"{failed} job{'s' if failed != 1 else ''} failed")
        raise typer.Exit(1)


def _open_batch(path: Path):
    import os
    import stat

    from kvsnap.errors import ConfigError
    from kvsnap.paths import kind_of

    # A regular file, or a pipe (a FIFO, `--batch <(make_jobs)`), which streams jobs as '-' does. A
    # folder or a device is refused: /dev/zero would be one endless line.
    try:
        mode = os.stat(path).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
            raise ConfigError(f"{path}: batch file is {kind_of(mode)}, not a regular file or a pipe")
        return path.open("rb")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such batch file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read batch file ({exc.strerror or exc})") from None


def _with(job, **changes):
    import dataclasses

    return dataclasses.replace(job, **changes)


def _stats_line(row: dict) -> str:
    parts = [
        f"{row['prompt_tokens']:,} prompt tokens",
        f"{row['hit_tokens']:,} reused ({row['reuse_ratio']:.0%})"
        + (f" (recomputed, not loaded: {row['reuse_reason']})" if row.get("reuse_decision") == "recompute" else ""),
        f"{row['prefill_tokens']:,} prefilled in {ui.plural(row['chunks'], 'chunk')}",
    ]
    if row.get("ttft_s") is not None:
        parts.append(f"ttft {row['ttft_s']:.3f} s")
    reason = f"stopped: {ui.stop_words(row['stop_reason'])}" if row["stop_reason"] == "context" else row["stop_reason"]
    parts.append(f"{ui.plural(row['new_tokens'], 'new token')} ({reason})")
    if "saved" in row:
        parts.append(f"saved {row['saved']['path']} ({ui.human_bytes(row['saved']['file_bytes'])})")
    return "[" + ", ".join(parts) + "]"
