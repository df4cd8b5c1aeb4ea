"""GGUF files converted once into standard Hugging Face folders under ``$KVSNAP_HOME/models``.

transformers dequantizes a GGUF on load (slowly), so kvsnap does it once and later loads read the
folder. A conversion is keyed by the file's content (its digest), never by how its path is spelled:
the same file given by another path, a link, or fetched from the hub is converted once.

The folder is a checkpoint any tool loads: ``config.json`` names its ``architectures``, and a tied
embedding is stored as ``model.embed_tokens.weight``, the name transformers saves it under. Folders an
earlier kvsnap wrote (the tied tensor stored once as ``lm_head.weight``, no ``architectures``) are
rewritten so when next resolved; their ready marker maps the new file's digest to the one their weights
had, so the model's fingerprint, and every snapshot made with it, stays the same
(``fingerprint.weights_digest``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvsnap.errors import ModelError
from kvsnap.format.atomic import fsync_dir, locked, replace_whole
from kvsnap.models import catalog
from kvsnap.models.fingerprint import (
    config_file,
    file_stamp,
    files_digest,
    raw_weights_digest,
    remember_weights_digest,
)
from kvsnap.paths import open_regular

Progress = Callable[[str], None]
WEIGHTS = "model.safetensors"


def noop(_: str) -> None:
    pass


def quiet_transformers() -> None:
    # transformers draws its own tqdm bars and warnings on stderr; kvsnap reports through `progress`.
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


def gguf_digest(path: Path) -> str:
    """The digest of a GGUF file's bytes, cached by the file's identity and times (as weight digests are)."""
    st = os.stat(path)
    key = hashlib.blake2b(str(path.resolve()).encode(), digest_size=8).hexdigest()
    cache_file = catalog.kvsnap_home() / "digests" / f"gguf-{key}.json"
    stamp = file_stamp(st)
    try:
        cached = json.loads(cache_file.read_text())
        if cached.get("stamp") == stamp and isinstance(cached.get("digest"), str):
            return cached["digest"]
    except (OSError, ValueError, AttributeError):
        pass
    h = hashlib.blake2b(digest_size=16)
    with open_regular(path, error=ModelError, what="GGUF file") as f:  # a FIFO would hang the read
        while chunk := f.read(1 << 22):
            h.update(chunk)
    digest = h.hexdigest()
    with contextlib.suppress(OSError):  # a read-only home only costs a re-hash next time
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        replace_whole(cache_file, [json.dumps({"stamp": stamp, "digest": digest}).encode()])
    return digest


def folder_for(gguf: Path, digest: str) -> Path:
    """Where the conversion of the GGUF file with ``digest`` lives: named after the file, found by its digest
    (the same file under another name is the conversion made already)."""
    root = catalog.models_root()
    made = sorted(p for p in root.glob(f"*-{digest[:16]}") if catalog.is_conversion(p)) if root.is_dir() else []
    if made:
        return made[0]
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", gguf.stem)[:64].lstrip(".") or "model"
    return root / f"{stem}-{digest[:16]}"


def convert_gguf(gguf: Path, folder: Path, *, progress: Progress = noop, name: str | None = None) -> Path:
    """Dequantize a GGUF model once into a safetensors folder (atomic: a ready marker is written last).
    ``name`` is what the model is called (``kvsnap models`` shows it); the file's path by default."""
    quiet_transformers()
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Two first runs at once must not both convert into one folder.
    with locked(folder.parent):
        # Another process may have converted it while we waited for the lock.
        if catalog.is_ready(folder):
            return folder
        for stale in folder.parent.glob(f".{folder.name}.*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a conversion that was killed
        return _convert_locked(gguf, folder, progress, name or str(gguf))


def _convert_locked(gguf: Path, folder: Path, progress: Progress, name: str) -> Path:
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
        save_dequantized(model, tmp)
        tokenizer.save_pretrained(tmp)
        source = {"source": str(gguf), "name": name, "converted_at": time.time()}
        (tmp / catalog.READY).write_text(json.dumps(source))
        # The file as first written fixes the weights' digest, whatever layout the folder is rewritten in.
        _standard_layout(tmp, model.config.architectures or [type(model).__name__], in_place=False)
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


def save_dequantized(model, folder: Path) -> None:
    """The model's config and weights as safetensors' ``save_model`` writes them (a shared tensor once).

    transformers refuses save_pretrained() on a model loaded from GGUF (it counts as quantized), though
    its weights are plain dequantized tensors by now: the config and weights are written directly.
    """
    from safetensors.torch import save_model

    config = model.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    save_model(model, str(folder / WEIGHTS))


# -- the standard layout ------------------------------------------------------------------------------


def needs_repair(folder: Path) -> bool:
    """A folder kvsnap converted whose config lacks ``architectures`` or whose weights store a shared
    tensor under one name only (read from the config and the weights file's header, nothing more)."""
    if not catalog.is_conversion(folder) or not (folder / WEIGHTS).is_file():
        return False
    try:
        if not config_file(folder).get("architectures"):
            return True
    except ModelError:
        return False  # the load says what is wrong with it
    return bool(_aliases(folder / WEIGHTS))


def repair(folder: Path, progress: Progress = noop) -> None:
    """Rewrite a folder an earlier kvsnap converted in the standard layout, in place and atomically; a
    folder that cannot be written (a read-only home) is left as it is and still loads."""
    try:
        with locked(folder.parent):
            if needs_repair(folder):  # another process may have done it meanwhile
                progress(f"rewriting {folder.name} as a standard checkpoint (one time)")
                _standard_layout(folder, None, in_place=True)
    except OSError:
        pass


def _aliases(weights: Path) -> dict[str, str]:
    """``{name not stored: name stored}`` for tensors safetensors' ``save_model`` stored once for two names."""
    try:
        from safetensors import safe_open

        with safe_open(str(weights), "np") as f:
            names = set(f.keys())
            metadata = f.metadata() or {}
    except Exception:
        return {}
    return {k: v for k, v in metadata.items() if isinstance(v, str) and v in names and k not in names}


def _standard_layout(folder: Path, architectures: list[str] | None, *, in_place: bool) -> None:
    """Store every tensor under the names transformers saves, and name the architectures in config.json.

    The ready marker maps the new weights file's digest to the digest the folder had (written before the
    weights are replaced: a crash in between leaves the old file, whose digest the mapping leaves alone).
    ``in_place``: a folder in use (its digests are cached), not a conversion's temp folder.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    weights = folder / WEIGHTS
    config = config_file(folder)
    before = raw_weights_digest(folder, cache=in_place)  # a new conversion's temp folder is not kept
    aliases = _aliases(weights)
    with safe_open(str(weights), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in list(f.keys())}  # noqa: SIM118 (a safe_open is not a dict)
    tied = config.get("tie_word_embeddings") is True
    for dropped, kept in aliases.items():
        # Tied: one tensor under the embedding's name, which transformers ties the output layer to.
        # Not tied: both names hold their own copy, as save_pretrained would write them.
        tensors[dropped] = tensors.pop(kept) if tied else tensors[kept].clone()
    fd, tmp = tempfile.mkstemp(prefix=f".{WEIGHTS}.", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": "pt"})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        after = files_digest([Path(tmp)], [WEIGHTS])
        mark = catalog.marker(folder)
        mapping = mark.get("weights_digest_of") if isinstance(mark.get("weights_digest_of"), dict) else {}
        mark["weights_digest_of"] = {**mapping, after: mapping.get(before, before)}
        mark["layout"] = "standard"
        catalog.write_marker(folder, mark)
        if not config.get("architectures"):
            config["architectures"] = architectures or _architectures(config)
            replace_whole(folder / "config.json", [(json.dumps(config, indent=2, sort_keys=True) + "\n").encode()])
        os.replace(tmp, weights)
        fsync_dir(folder)
        if in_place:
            remember_weights_digest(folder, after)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _architectures(config: dict) -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type", ""))
    if not isinstance(name, str):
        raise ModelError(f"unknown model_type {config.get('model_type')!r}")
    return [name]
