"""Models by name from the Hugging Face hub: ``org/name`` (a safetensors repo) or ``org/name:FILE.gguf``.

Downloads go through ``huggingface_hub`` into its own cache: a dropped connection resumes the file
where it stopped, and the files a stopped download finished are kept for the next one. The
environment is read when a download starts, not when ``huggingface_hub`` was imported: ``HF_ENDPOINT``
(a mirror, or the tests' fake hub), ``HF_HOME`` / ``HF_HUB_CACHE`` (where the cache is), ``HF_TOKEN``
(private and gated repos) and ``HF_HUB_OFFLINE`` (the local cache only).
A model already complete in the cache is used without asking the network; ``kvsnap pull`` asks.

huggingface_hub builds cache paths from what the server says (the commit id, each file's ETag), so a
hostile ``HF_ENDPOINT`` could name a path outside the cache: kvsnap lists the repo once and fetches
each file it needs with every answer checked (``hub_answers``).
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvsnap.errors import ModelError, one_line
from kvsnap.models import catalog
from kvsnap.models import hub_answers as answers

Progress = Callable[[str], None]

# What a safetensors model needs: weights, config and tokenizer; never other weights formats (.bin, .pt,
# .gguf, .onnx, ...), which a repo often carries besides and which would multiply the download.
MODEL_FILES = (
    "*.safetensors",
    "model.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "*.tiktoken",
    "chat_template.jinja",
    "chat_template.json",
)
_REPORT_EVERY_S = 0.25
_PARALLEL = 8  # files fetched at once, as huggingface_hub's snapshot_download does


def parse_name(spec: str) -> tuple[str, str | None] | None:
    """``org/name`` -> (repo, None); ``org/name:FILE.gguf`` -> (repo, FILE.gguf); else None (not a hub name)."""
    repo, sep, file = spec.partition(":")
    if sep and not file.endswith(".gguf"):
        return None
    parts = repo.split("/")
    if len(parts) != 2 or not all(parts) or repo.startswith((".", "~")):
        return None
    allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")
    if not all(set(p) <= allowed for p in parts) or any(p.startswith(".") for p in parts):
        return None
    if sep and (not file or file.startswith("/") or ".." in file.split("/")):
        return None
    return repo, (file or None)


def offline() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in ("1", "on", "yes", "true")


def hub_cache() -> Path:
    """The Hugging Face cache folder, as ``huggingface_hub`` finds it from the environment."""
    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return Path(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"]).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def repo_cache(repo: str) -> Path:
    return hub_cache() / ("models--" + repo.replace("/", "--"))


def fetch(repo: str, file: str | None = None, *, progress: Progress, refresh: bool = False) -> Path:
    """The local path of hub model ``repo`` (its snapshot folder) or of ``file`` in it, downloading what
    the cache lacks. ``refresh`` asks the hub for a newer revision even when the cache is complete."""
    name = f"{repo}:{file}" if file else repo
    cached = _cached(repo, file)
    if cached is not None and not (refresh and not offline()):
        return cached
    if offline():
        raise ModelError(
            f"{name} is not downloaded and HF_HUB_OFFLINE is set: unset it and run `kvsnap pull {name}`, "
            "or give a local model folder"
        )
    # Noted before the download, so a cache entry a failed first attempt left is still known as kvsnap's.
    catalog.record_hub_download(name, repo_cache(repo), made=not repo_cache(repo).exists(), complete=False)
    try:
        with _quiet_hub():
            path = _download(repo, file, name, progress)
    except ModelError:
        raise
    except Exception as exc:
        if not repo_cache(repo).exists():
            catalog.forget_hub_download(name)  # nothing was written: no trace of a mistyped name
        problem = _problem(exc, repo, file)
        if cached is not None and problem.startswith("cannot reach"):
            progress(f"{problem}; using the copy in the local cache")
            return cached
        raise ModelError(problem) from None
    catalog.record_hub_download(name, repo_cache(repo), made=False, complete=True)
    return path


def _cached(repo: str, file: str | None) -> Path | None:
    """The complete local copy, or None (never asks the network)."""
    from huggingface_hub import hf_hub_download, snapshot_download

    try:
        with _quiet_hub():
            if file is not None:
                found = Path(hf_hub_download(repo, file, cache_dir=hub_cache(), local_files_only=True))
            else:
                found = Path(
                    snapshot_download(repo, cache_dir=hub_cache(), local_files_only=True, allow_patterns=MODEL_FILES)
                )
        if not answers.inside_cache(repo_cache(repo), found):
            return None  # fetched again, through the checks, which refuse what is there
    except Exception:
        return None
    return found if file is not None or (found / "config.json").is_file() else None


def _download(repo: str, file: str | None, name: str, progress: Progress) -> Path:
    from huggingface_hub import HfApi, get_session, hf_hub_download

    token = os.environ.get("HF_TOKEN") or None
    bar = progress_bar_class(name, progress)
    info = HfApi(endpoint=endpoint(), token=token).model_info(repo, files_metadata=True)
    commit, sizes = answers.listing(endpoint(), repo, info)
    if file is not None:
        if file not in sizes:
            raise ModelError(f"{repo} has no file {file}")
        wanted = [file]
    else:
        files = list(sizes)
        if "config.json" not in files or not any(f.endswith(".safetensors") for f in files):
            ggufs = [f for f in files if f.endswith(".gguf")]
            hint = f"; a GGUF in it is named {repo}:{ggufs[0]}" if ggufs else ""
            raise ModelError(
                f"{repo} has no safetensors weights with a config.json (kvsnap takes those or a .gguf){hint}"
            )
        wanted = [f for f in files if any(fnmatch.fnmatch(f, pattern) for pattern in MODEL_FILES)]
    for f in wanted:
        answers.check_declared(endpoint(), repo, f, sizes[f])
    hooks = get_session().event_hooks["response"]
    if answers.check_response not in hooks:
        hooks.append(answers.check_response)  # the shared client's: every request of the download passes it

    def one(f: str) -> Path:
        expected = answers.Expected(endpoint(), repo_cache(repo), repo, f, commit, sizes[f] or 0)
        with answers.expecting(expected):
            path = hf_hub_download(repo, f, cache_dir=hub_cache(), endpoint=endpoint(), token=token, tqdm_class=bar)
        return answers.check_file(expected, Path(path))

    with ThreadPoolExecutor(max_workers=min(_PARALLEL, len(wanted))) as pool:
        paths = list(pool.map(one, wanted))
    return paths[0] if file is not None else repo_cache(repo) / "snapshots" / commit


def _problem(exc: Exception, repo: str, file: str | None) -> str:
    """One line saying what went wrong with a download, and what to do."""
    from huggingface_hub import errors

    where = endpoint()
    if isinstance(exc, errors.GatedRepoError):
        return f"{repo} is gated: accept its terms on {where}/{repo}, then set HF_TOKEN to a token of that account"
    if isinstance(exc, errors.RepositoryNotFoundError):
        private = "" if os.environ.get("HF_TOKEN") else "; a private one needs HF_TOKEN"
        return f"{repo}: no such model on {where}{private}"
    if isinstance(exc, errors.RevisionNotFoundError):
        return f"{repo}: no such revision on {where}"
    if isinstance(exc, errors.RemoteEntryNotFoundError):
        return f"{repo} has no file {file}" if file else f"{repo}: a file it lists is not on {where}"
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, errors.HfHubHTTPError) and status is not None and status < 500:
        return f"{where} refused {repo} (HTTP {status}): {one_line(exc)}"
    if isinstance(exc, OSError) and getattr(exc, "errno", None) is not None:
        return f"cannot write the download to {hub_cache()} ({exc.strerror or exc})"
    return (
        f"cannot reach {where} to download {repo} ({type(exc).__name__}) and it is not in the local cache: "
        "connect and run it again (the files already downloaded are kept), or set HF_ENDPOINT to a mirror"
    )


@contextlib.contextmanager
def _quiet_hub() -> Iterator[None]:
    """huggingface_hub logs retries and warnings to stderr; kvsnap reports through ``progress`` instead."""
    logger = logging.getLogger("huggingface_hub")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def progress_bar_class(name: str, progress: Progress) -> type:
    """A stand-in for tqdm that huggingface_hub draws its bars with: the bytes written so far, against
    the total, go to ``progress`` a few times a second instead of to stderr."""
    lock = threading.Lock()
    shown = [0.0]

    class Bar:
        def __init__(self, *args, total=None, initial=0, unit="it", desc=None, **kwargs):
            self.total, self.n, self.unit, self.desc = total, initial or 0, unit, desc or ""
            self.format_dict: dict = {}

        def update(self, n=1):
            self.n += n or 0
            if self.unit != "B" or self.desc.startswith("Downloading bytes"):
                return  # the file count, and the network bytes (the bytes written are shown instead)
            now = time.monotonic()
            with lock:
                if now - shown[0] < _REPORT_EVERY_S and (not self.total or self.n < self.total):
                    return
                shown[0] = now
            total = f" of {_mb(self.total)}" if self.total else ""
            progress(f"downloading {name}: {_mb(self.n)}{total}")

        def refresh(self, *args, **kwargs):
            pass

        def close(self):
            pass

        def set_description(self, *args, **kwargs):
            pass

        set_description_str = set_postfix_str = set_postfix = set_description

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    return Bar


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB" if n < 10e6 else f"{n / 1e6:,.0f} MB"
