"""``kvsnap run``'s jobs: one prompt or a JSONL batch of jobs, each run through a ``Session``.

A job is ``{"id", "prompt" | "prompt_file" | "messages", "resume"?, "resume_if_exists"?, "save"?,
"max_new_tokens"?, "temperature"?, "top_p"?, "top_k"?, "seed"?, "chat"?, "system"?}``.
``prompt_file`` and ``prompt`` together mean the file's text followed by the prompt (a long document, then a question).
Paths are used as given; nothing is run through a shell.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from kvsnap.config import SamplingParams
from kvsnap.errors import ConfigError, KvsnapError
from kvsnap.paths import read_bounded
from kvsnap.types import chat_messages

_SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed")
_JOB_FIELDS = {"id", "prompt", "prompt_file", "messages", "chat", "system", "resume", "resume_if_exists", "save"}
_JOB_FIELDS.update(_SAMPLING_FIELDS)
MAX_PROMPT_FILE_BYTES = 64 << 20
MAX_LINE_BYTES = 64 << 20  # one batch line (a job with its prompt inline)


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
    resume_if_exists: bool = False  # a missing resume file means a cold run, not an error

    def params(self, defaults: SamplingParams) -> SamplingParams:
        return dataclasses.replace(defaults, **dict(self.overrides))


def read_prompt_file(path: str) -> str:
    """A prompt file's text: a regular file (a FIFO would hang, /dev/zero never end), bounded, UTF-8."""
    data = read_bounded(path, MAX_PROMPT_FILE_BYTES, error=ConfigError, what="prompt file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: prompt file is not valid UTF-8 (byte {exc.start + 1:,})") from None


def check_text(name: str, text: str | None) -> None:
    """Refuse text that cannot be encoded: a lone surrogate from JSON ("\\ud800") or from invalid
    UTF-8 bytes in an argument (Python keeps them as surrogate escapes) would fail in the tokenizer."""
    if text is None:
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{name} is not valid UTF-8 text") from None


def read_lines(stream: BinaryIO, limit: int = MAX_LINE_BYTES) -> Iterator[bytes]:
    """A batch's lines as bytes, each cut at ``limit + 1`` bytes: the rest of a longer line is
    skipped, never held (a line that never ends, as from /dev/zero, cannot fill the memory)."""
    while line := stream.readline(limit + 1):
        if len(line) > limit and not line.endswith(b"\n"):
            while (rest := stream.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass
        yield line


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
    for key in ("prompt", "system"):
        check_text(f'"{key}"', raw.get(key))
    messages = chat_messages(raw.get("messages"))
    if messages is False:
        raise ConfigError('"messages" must be a list of {"role", "content"} objects')
    for m in messages or ():
        check_text('"messages"', m["role"] + m["content"])
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
    for key in ("chat", "resume_if_exists"):
        if not isinstance(raw.get(key, False), bool):
            raise ConfigError(f'"{key}" must be true or false')
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
        resume_if_exists=raw.get("resume_if_exists", False),
    )


def parse_jobs(lines: Iterable[str | bytes], defaults: SamplingParams) -> Iterator[Job | tuple[Any, str]]:
    """Jobs in input order; a bad line yields ``(id, error message)`` instead of stopping the batch.

    Lines may be bytes (see ``read_lines``): each is decoded on its own, so one line that is not
    UTF-8 is one error row, not the end of the batch.
    """
    for n, line in enumerate(lines, start=1):
        if isinstance(line, bytes):
            if len(line.rstrip(b"\r\n")) > MAX_LINE_BYTES:
                yield (n, f"line {n}: longer than {MAX_LINE_BYTES >> 20} MiB")
                continue
            try:
                line = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield (n, f"line {n}: not valid UTF-8 (byte {exc.start + 1:,})")
                continue
        if not line.strip():
            continue
        try:
            # A number JSON cannot hold (1e400, NaN, Infinity) stays the text it was written as:
            # an id keeps its spelling and the output stays strict JSON; a setting is refused.
            raw = json.loads(line, parse_float=_finite_or_text, parse_constant=str)
        except json.JSONDecodeError as exc:
            # No id can be read from the line: the row says which line, and its id is null.
            yield (None, f"line {n}: not valid JSON ({exc.msg} at column {exc.colno})")
            continue
        except (ValueError, RecursionError):
            yield (None, f"line {n}: not valid JSON (nested too deeply)")
            continue
        try:
            job = job_from_dict(raw, default_id=n)
            job.params(defaults)  # sampling settings are checked here, not half way through the batch
            yield job
        except ConfigError as exc:
            yield (raw.get("id", n) if isinstance(raw, dict) else n, f"line {n}: {exc}")


def _finite_or_text(text: str) -> float | str:
    value = float(text)
    return value if math.isfinite(value) else text


def prompt_ids(session, job: Job) -> list[int]:
    """Token ids of a job's prompt: raw text, or chat-template-rendered messages."""
    messages = job_messages(job)
    if messages is not None:
        return session.render_chat(messages)
    text = (read_prompt_file(job.prompt_file) if job.prompt_file else "") + (job.prompt or "")
    return encode_text(session.lm.tokenizer, text)


def job_messages(job: Job) -> list[dict[str, str]] | None:
    """The chat messages a job's prompt renders (its own, or --chat's system and user message); None for raw text."""
    if job.messages is not None:
        return [dict(m) for m in job.messages]
    if not job.chat:
        return None
    text = (read_prompt_file(job.prompt_file) if job.prompt_file else "") + (job.prompt or "")
    return ([{"role": "system", "content": job.system}] if job.system else []) + [{"role": "user", "content": text}]


def encode_text(tokenizer, text: str) -> list[int]:
    """Raw text to token ids, the tokenizer's own way (special tokens as its config says)."""
    return list(tokenizer(text)["input_ids"])


def run_job(
    session,
    job: Job,
    defaults: SamplingParams,
    on_text=None,
    on_progress=None,
    store_session: str | None = None,
) -> dict[str, Any]:
    """Run one job on a fresh session state; returns its result row (raises ``KvsnapError`` on failure).

    With ``resume_if_exists`` a missing resume file is a cold run, and the row says ``"resume_missing": true``.
    """
    session.reset()
    ids = prompt_ids(session, job)
    messages = job_messages(job)

    def keep(gen) -> None:
        # A chat job's snapshot records its conversation, as a chat's does: explain and a later chat read it.
        if messages is not None:
            answer = [{"role": "assistant", "content": gen.text}] if gen is not None else []
            session.messages = [*messages, *answer]

    resume = job.resume
    missing = resume is not None and not Path(resume).exists()
    if missing and not job.resume_if_exists:
        raise ConfigError(f"{resume}: no such snapshot to resume (--resume-if-exists runs cold instead)")
    result = session.run(
        ids,
        job.params(defaults),
        resume=None if missing else resume,
        on_text=on_text,
        on_progress=on_progress,
        store_session=store_session,
        on_generated=keep,
        prompt_messages=messages,
    )
    row: dict[str, Any] = {"id": job.id, **result.to_dict()}
    if missing:
        row["resume_missing"] = True
    if job.save is not None:
        saved = session.save(job.save)
        row["saved"] = {"path": saved.path, "tokens": saved.tokens, "file_bytes": saved.file_bytes}
    return row


def check_save_target(path: str | Path | None, *, foreign: bool = True) -> None:
    """Fail before any work if a save could not even start or would be refused: its folder is missing
    or cannot be written, the target is a symlink, a special file or (``foreign``) a file that is not
    a snapshot (see ``kvsnap.format.writer.check_snapshot_target``)."""
    if path is None:
        return
    from kvsnap.format.writer import check_snapshot_target

    check_snapshot_target(Path(path).expanduser(), error=ConfigError, foreign=foreign)


def error_row(job_id: Any, exc: KvsnapError | str) -> dict[str, Any]:
    return {"id": job_id, "error": str(exc)}
