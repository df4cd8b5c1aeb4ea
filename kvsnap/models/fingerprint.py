"""The model fingerprint: what changes the KV a model computes, as digests.

It seeds every hash chain, so a snapshot of another model (config, RoPE, tokenizer, weights or
cache dtype) never matches. The parts are kept apart so a refusal can say which one differs.
No torch here.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from kvsnap.errors import ModelError
from kvsnap.models import catalog
from kvsnap.models.catalog import kvsnap_home
from kvsnap.paths import open_regular, read_bounded

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "chat_template.jinja",
)
# Config keys that do not change the KV a model computes.
_VOLATILE_CONFIG = {
    "transformers_version",
    "_name_or_path",
    "torch_dtype",
    "dtype",
    "architectures",
    "use_cache",
}


def file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open_regular(path, error=ModelError, what="model file") as f:  # a FIFO would hang the read
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def weights_digest(folder: Path) -> str:
    """Digest of the weight files; cached under $KVSNAP_HOME, keyed by each file's identity and times.

    Size and mtime alone are fooled by an in-place rewrite that restores the mtime (``touch -r``,
    ``cp -p``, ``os.utime``), and a stale digest would let a snapshot of the old weights resume
    against the new ones. The key adds the inode and the ctime, which every write moves and no
    user can set back.

    A folder kvsnap converted and later rewrote in the standard layout (``kvsnap.models.convert``)
    keeps the digest its weights had as first written: its ready marker maps the new file's digest to
    that one, so the same tensors keep one fingerprint and its snapshots still resume. The marker is
    trusted only in kvsnap's own models folder; any other content hashes to itself.
    """
    digest = raw_weights_digest(folder)
    if catalog.is_conversion(folder):
        recorded = catalog.marker(folder).get("weights_digest_of")
        if isinstance(recorded, dict) and isinstance(recorded.get(digest), str):
            return recorded[digest]
    return digest


def raw_weights_digest(folder: Path, *, cache: bool = True) -> str:
    """The digest of the weight files' bytes as they are (``weights_digest`` before a marker's mapping)."""
    files = weight_files(folder)
    if not files:
        raise ModelError(f"{folder}: no weight files")
    stamp = [[p.name, *file_stamp(p.stat())] for p in files]
    key = hashlib.blake2b(str(folder.resolve()).encode(), digest_size=8).hexdigest()
    cache_file = kvsnap_home() / "digests" / f"{key}.json"
    try:
        cached = json.loads(cache_file.read_text()) if cache else {}
        if cached.get("stamp") == stamp:
            return cached["digest"]
    except (OSError, ValueError, AttributeError):
        pass
    digest = files_digest(files)
    if cache:
        _remember(cache_file, stamp, digest)
    return digest


def remember_weights_digest(folder: Path, digest: str) -> None:
    """Record ``digest`` as the raw digest of ``folder``'s weight files as they are now (one that was just
    computed while writing them), so the next load does not hash them again."""
    files = weight_files(folder)
    key = hashlib.blake2b(str(folder.resolve()).encode(), digest_size=8).hexdigest()
    _remember(kvsnap_home() / "digests" / f"{key}.json", [[p.name, *file_stamp(p.stat())] for p in files], digest)


def _remember(cache_file: Path, stamp: list, digest: str) -> None:
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"stamp": stamp, "digest": digest}))
        os.replace(tmp, cache_file)
    except OSError:
        pass  # a read-only home only costs a re-hash next time


def weight_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".gguf"))


def files_digest(files: list[Path], names: list[str] | None = None) -> str:
    """The digest of weight files by name and content (``names``: the names they will have, if not theirs)."""
    h = hashlib.blake2b(digest_size=16)
    for p, name in zip(files, names or [p.name for p in files]):
        h.update(name.encode() + b"\0" + file_digest(p).encode())
    return h.hexdigest()


def file_stamp(st: os.stat_result) -> list[int]:
    """A file's identity and times: any write changes it (its ctime), whatever it does to size and mtime."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def tokenizer_digest(folder: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in _TOKENIZER_FILES:
        p = folder / name
        if p.is_file():
            h.update(name.encode() + b"\0" + file_digest(p).encode())
    return h.hexdigest()


def config_file(folder: Path) -> dict[str, Any]:
    """The model's config.json as written: ``config.to_dict()`` adds class defaults that move with
    the transformers version and would make every snapshot look foreign after an upgrade."""
    path = folder / "config.json"
    try:  # a regular file, read bounded: a FIFO or a device would hang or fill memory
        data = json.loads(read_bounded(path, 16 << 20, error=ModelError, what="model config"))
    except (ValueError, RecursionError) as exc:
        raise ModelError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ModelError(f"{folder / 'config.json'} is not a JSON object")
    return data


def config_digest(config_dict: dict[str, Any]) -> str:
    clean = {k: v for k, v in config_dict.items() if k not in _VOLATILE_CONFIG}
    return hashlib.blake2b(json.dumps(clean, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()


def fingerprint_parts(
    folder: Path, config_dict: dict[str, Any], kv_dtype: str, quantization: str = "none"
) -> dict[str, str]:
    """The digests that make up a fingerprint, kept apart so a refusal can say which one differs.

    ``quantization`` (``int8``, ``int4``: weights quantized at load) is a part only when the weights are
    quantized, so a float model keeps the fingerprint, and the snapshots, it always had."""
    parts = {
        "config": config_digest(config_dict),
        "tokenizer": tokenizer_digest(folder),
        "weights": weights_digest(folder),
        "kv_dtype": kv_dtype,
    }
    if quantization != "none":
        parts["quantization"] = quantization
    return parts


def fingerprint(folder: Path, config_dict: dict[str, Any], kv_dtype: str) -> str:
    """What changes the KV: config (RoPE included), tokenizer, weights and the cache dtype."""
    return fingerprint_of(fingerprint_parts(folder, config_dict, kv_dtype))


def fingerprint_of(parts: dict[str, str]) -> str:
    text = "|".join(f"{k}:{parts[k]}" for k in ("config", "tokenizer", "weights", "kv_dtype"))
    if parts.get("quantization", "none") != "none":
        text += f"|quantization:{parts['quantization']}"
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
