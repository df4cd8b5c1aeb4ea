"""``kvsnap run``'s jobs: one prompt or a JSONL batch of jobs, each run through a ``Session``.

A job is ``{"id", "prompt" | "prompt_file" | "messages", "resume"?, "save"?, "max_new_tokens"?,
"temperature"?, "top_p"?, "top_k"?, "seed"?, "chat"?, "system"?}``. ``prompt_file`` and ``prompt``
together mean the file's text followed by the prompt (a long document, then a question).
Paths are used as given; nothing is run through a shell.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsnap.config import SamplingParams
from kvsnap.errors import ConfigError, KvsnapError
from kvsnap.types import chat_messages

_SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed")
_JOB_FIELDS = {"id", "prompt", "prompt_file", "messages", "resume", "save", "chat", "system", *_SAMPLING_FIELDS}
MAX_PROMPT_FILE_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class Job:
    id: Any
    prompt: str | None = None
    prompt_file: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    chat: bool = False
    system: str | None = None
    resume: str | None = None
    save: str | None = None
    overrides: tuple[tuple[str, Any], ...] = ()

    def params(self, defaults: SamplingParams) -> SamplingParams:
        return dataclasses.replace(defaults, **dict(self.overrides))


def read_prompt_file(path: str) -> str:
    p = Path(path)
    try:
        if p.stat().st_size > MAX_PROMPT_FILE_BYTES:
            raise ConfigError(f"{path}: prompt file larger than {MAX_PROMPT_FILE_BYTES >> 20} MiB")
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such prompt file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read prompt file ({exc})") from None


def job_from_dict(raw: Any, default_id: Any) -> Job:
    """Validate one batch row; raises ``ConfigError`` with what is wrong."""
    if not isinstance(raw, dict):
        raise ConfigError("a job must be a JSON object")
    unknown = set(raw) - _JOB_FIELDS
    if unknown:
        raise ConfigError(f"unknown job fields: {', '.join(sorted(unknown))}")
    sources = [k for k in ("prompt", "prompt_file", "messages") if raw.get(k) is not None]
    if not sources:
        raise ConfigError('a job needs "prompt", "prompt_file" or "messages"')
    if "messages" in sources and len(sources) > 1:
        raise ConfigError('"messages" cannot be combined with "prompt" or "prompt_file"')
    for key in ("prompt", "prompt_file", "resume", "save", "system"):
        if raw.get(key) is not None and not isinstance(raw[key], str):
            raise ConfigError(f'"{key}" must be a string')
    messages = chat_messages(raw.get("messages"))
    if messages is False:
        raise ConfigError('"messages" must be a list of {"role", "content"} objects')
    overrides = []
    for key in _SAMPLING_FIELDS:
        if raw.get(key) is not None:
            value = raw[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f'"{key}" must be a finite number')
            if key in ("max_new_tokens", "top_k", "seed"):
                if value != int(value):
                    raise ConfigError(f'"{key}" must be a whole number')
                value = int(value)
            overrides.append((key, float(value) if key in ("temperature", "top_p") else value))
    if not isinstance(raw.get("chat", False), bool):
        raise ConfigError('"chat" must be true or false')
    return Job(
        id=raw.get("id", default_id),
        prompt=raw.get("prompt"),
        prompt_file=raw.get("prompt_file"),
        messages=messages,
        chat=raw.get("chat", False),
        system=raw.get("system"),
        resume=raw.get("resume"),
        save=raw.get("save"),
        overrides=tuple(overrides),
    )


def parse_jobs(lines: Iterable[str], defaults: SamplingParams) -> Iterator[Job | tuple[Any, str]]:
    """Jobs in input order; a bad line yields ``(id, error message)`` instead of stopping the batch."""
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except (ValueError, RecursionError) as exc:
            yield (n, f"line {n}: not valid JSON ({exc})")
            continue
        try:
            job = job_from_dict(raw, default_id=n)
            job.params(defaults)  # sampling settings are checked here, not half way through the batch
            yield job
        except ConfigError as exc:
            yield (raw.get("id", n) if isinstance(raw, dict) else n, f"line {n}: {exc}")


def prompt_ids(session, job: Job) -> list[int]:
    """Token ids of a job's prompt: raw text, or chat-template-rendered messages."""
    if job.messages is not None:
        return session.render_chat(job.messages)
    text = (read_prompt_file(job.prompt_file) if job.prompt_file else "") + (job.prompt or "")
    if job.chat:
        messages = ([{"role": "system", "content": job.system}] if job.system else []) + [
            {"role": "user", "content": text}
        ]
        return session.render_chat(messages)
    return encode_text(session.lm.tokenizer, text)


def encode_text(tokenizer, text: str) -> list[int]:
    """Raw text to token ids, the tokenizer's own way (special tokens as its config says)."""
    return list(tokenizer(text)["input_ids"])


def run_job(
    session,
    job: Job,
    defaults: SamplingParams,
    on_text=None,
    on_progress=None,
    on_mismatch: str = "error",
    store_session: str | None = None,
) -> dict[str, Any]:
    """Run one job on a fresh session state; returns its result row (raises ``KvsnapError`` on failure)."""
    session.reset()
    ids = prompt_ids(session, job)
    if job.resume is not None and not Path(job.resume).exists():
        raise ConfigError(f"{job.resume}: no such snapshot to resume")
    result = session.run(
        ids,
        job.params(defaults),
        resume=job.resume,
        on_text=on_text,
        on_progress=on_progress,
        on_mismatch=on_mismatch,
        store_session=store_session,
    )
    row: dict[str, Any] = {"id": job.id, **result.to_dict()}
    if job.save is not None:
        saved = session.save(job.save)
        row["saved"] = {"path": saved.path, "tokens": saved.tokens, "file_bytes": saved.file_bytes}
    return row


def check_save_target(path: str | Path | None) -> None:
    """Fail before any work if a save could not even start (its folder is missing)."""
    if path is None:
        return
    folder = Path(path).expanduser().resolve().parent
    if not folder.is_dir():
        raise ConfigError(f"{path}: cannot save there, folder {folder} does not exist")


def error_row(job_id: Any, exc: KvsnapError | str) -> dict[str, Any]:
    return {"id": job_id, "error": str(exc)}
