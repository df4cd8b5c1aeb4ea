"""What kvsnap keeps of models: converted folders under ``$KVSNAP_HOME/models`` (each marked ready by
kvsnap), a record of the Hugging Face hub downloads it made, and the quantized forms of models it kept
under ``$KVSNAP_HOME/quantized`` (``kvsnap.models.quantized_file``); listing them and removing one.

Only what kvsnap made is ever removed: a folder under ``$KVSNAP_HOME/models`` holding kvsnap's ready
marker, or a hub cache entry that did not exist before kvsnap downloaded it. No torch here.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsnap.config import DEFAULT_MODEL
from kvsnap.errors import ModelError
from kvsnap.format.atomic import fsync_dir, locked, replace_whole
from kvsnap.paths import json_object

READY = ".kvsnap-ready"
HUB_RECORD = ".hub-downloads.json"
_MAX_WALK = 100_000  # entries counted when sizing a folder: a model folder holds a few dozen


def kvsnap_home() -> Path:
    return Path(os.environ.get("KVSNAP_HOME") or Path.home() / ".cache" / "kvsnap")


def models_root() -> Path:
    return kvsnap_home() / "models"


def quantized_root() -> Path:
    return kvsnap_home() / "quantized"


def quantized_stem(source: Path) -> str:
    """The start of the file names of the quantized forms kept of the model in ``source``: its folder's
    name, and a digest of its path (two folders of one name keep forms apart)."""
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in source.name)[:80]
    where = hashlib.blake2b(str(source.resolve()).encode(), digest_size=4).hexdigest()
    return f"{name}-{where}"


def quantized_forms(source: Path | None = None) -> list[Path]:
    """The quantized forms kept of the model in ``source`` (every one kept, when None): regular files only."""
    pattern = f"{quantized_stem(source)}-*.safetensors" if source is not None else "*.safetensors"
    try:
        found = quantized_root().glob(pattern)
        return sorted(p for p in found if stat.S_ISREG(os.lstat(p).st_mode))
    except OSError:
        return []


def is_ready(folder: Path) -> bool:
    return (folder / READY).is_file()


def marker(folder: Path) -> dict[str, Any]:
    """The ready marker a conversion wrote (empty when missing or unreadable)."""
    return json_object(folder / READY, 1 << 20) or {}


def write_marker(folder: Path, data: dict[str, Any]) -> None:
    replace_whole(folder / READY, [json.dumps(data, indent=1, sort_keys=True).encode()])
    fsync_dir(folder)


def is_conversion(folder: Path) -> bool:
    """``folder`` is one kvsnap made: a real folder directly under ``$KVSNAP_HOME/models`` with its
    ready marker. What a marker says about weights is trusted only there (``fingerprint``)."""
    try:
        st = os.lstat(folder)
        root = models_root().resolve()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and folder.parent.resolve() == root and is_ready(folder)


# -- the hub downloads kvsnap made ------------------------------------------------------------------


def hub_record() -> dict[str, dict[str, Any]]:
    """``{name: {"cache": repo cache folder, "made": kvsnap created it}}`` for each hub model fetched."""
    raw = json_object(models_root() / HUB_RECORD, 4 << 20) or {}
    return {k: v for k, v in raw.items() if isinstance(v, dict) and isinstance(v.get("cache"), str)}


def record_hub_download(name: str, cache: Path, *, made: bool, complete: bool) -> None:
    """Note that ``name`` is fetched into the hub cache folder ``cache`` (``made``: it was not there
    before; ``complete``: the download finished). A name seen again keeps its first ``made``: kvsnap did
    not make what was there already, and what it made stays its own."""
    root = models_root()
    root.mkdir(parents=True, exist_ok=True)
    with locked(root, best_effort=True, timeout=10):
        record = hub_record()
        earlier = record.get(name, {})
        made = bool(earlier.get("made", made))
        record[name] = {"cache": str(cache), "made": made, "complete": complete or bool(earlier.get("complete"))}
        replace_whole(root / HUB_RECORD, [json.dumps(record, indent=1, sort_keys=True).encode()])


def forget_hub_download(name: str) -> None:
    """Drop ``name`` from the record, deleting nothing (a download that failed before writing anything)."""
    root = models_root()
    with locked(root, best_effort=True, timeout=10):
        record = hub_record()
        if record.pop(name, None) is not None:
            replace_whole(root / HUB_RECORD, [json.dumps(record, indent=1, sort_keys=True).encode()])


# -- listing ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One model kvsnap keeps: ``name`` is what ``--model`` takes and what its snapshots record."""

    name: str
    kind: str  # "default", "gguf" (a converted .gguf file), "hub" (a hub download) or "partial" (one unfinished)
    path: Path
    bytes: int
    source: str | None = None
    quantized: tuple[tuple[Path, int], ...] = ()  # its quantized forms kept: (file, bytes), counted in ``bytes``

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "path": str(self.path),
            "bytes": self.bytes,
            "source": self.source,
            "quantized": [{"path": str(p), "bytes": n} for p, n in self.quantized],
        }


def list_models() -> list[ModelEntry]:
    """Converted folders under ``$KVSNAP_HOME/models``, then the hub downloads kvsnap recorded that are still
    in the cache; by name."""
    found: list[ModelEntry] = []
    root = models_root()
    try:
        names = sorted(os.listdir(root))
    except OSError:
        names = []
    for name in names:
        folder = root / name
        if name.startswith(".") or not is_conversion(folder):
            continue
        source = marker(folder).get("source")
        source = source if isinstance(source, str) else None
        label = marker(folder).get("name")
        forms = _sized(quantized_forms(folder))
        size = folder_bytes(folder) + sum(n for _, n in forms)
        if name == DEFAULT_MODEL:
            found.append(ModelEntry(DEFAULT_MODEL, "default", folder, size, source, forms))
        else:
            label = label if isinstance(label, str) else name
            found.append(ModelEntry(label, "gguf", folder, size, source, forms))
    for name, info in sorted(hub_record().items()):
        cache = Path(info["cache"])
        if cache.is_dir():  # a hub GGUF shows twice: its download here, its conversion above
            kind = "hub" if info.get("complete") else "partial"  # a download that has not finished yet
            forms = _sized([p for snapshot in _snapshots(cache) for p in quantized_forms(snapshot)])
            found.append(ModelEntry(name, kind, cache, folder_bytes(cache) + sum(n for _, n in forms), None, forms))
    # Forms of folders kvsnap does not keep (a local folder's): listed on their own, removable by file name.
    claimed = {p for e in found for p, _ in e.quantized}
    for path, n in _sized([p for p in quantized_forms() if p not in claimed]):
        found.append(ModelEntry(path.name, "quantized", path, n, None, ((path, n),)))
    return found


def _sized(paths: list[Path]) -> tuple[tuple[Path, int], ...]:
    out = []
    for p in paths:
        try:
            out.append((p, os.lstat(p).st_size))
        except OSError:
            continue
    return tuple(out)


def _snapshots(cache: Path) -> list[Path]:
    try:
        return [p for p in (cache / "snapshots").iterdir() if p.is_dir()]
    except OSError:
        return []


def folder_bytes(folder: Path) -> int:
    """Bytes of the regular files under ``folder``; links are not followed (a hub cache's snapshot
    files are links to its blobs, which are counted once)."""
    total, seen = 0, 0
    stack = [folder]
    while stack and seen < _MAX_WALK:
        try:
            with os.scandir(stack.pop()) as entries:
                for entry in entries:
                    seen += 1
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(Path(entry.path))
                    elif entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_size
        except OSError:
            continue
    return total


# -- removing ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Removal:
    removed: list[Path]
    kept: list[str]  # what was left, and why


def remove_model(name: str) -> Removal:
    """Remove the model ``name`` (as ``list_models`` shows it, or its folder's name) and nothing else.

    A converted folder goes; a hub download goes from the cache when kvsnap made that cache entry and no
    other model kvsnap keeps uses it. Anything else is refused with ``ModelError``.
    """
    entries = list_models()
    matches = [e for e in entries if name in (e.name, e.path.name)]
    record = hub_record()
    if not matches and name in record:  # a GGUF fetched from the hub whose conversion is gone already
        matches = [ModelEntry(name, "hub", Path(record[name]["cache"]), 0)]
    if not matches:
        known = ", ".join(e.name for e in entries) or "none"
        raise ModelError(f"no model {name!r} among those kvsnap keeps (kvsnap models lists them: {known})")
    removed: list[Path] = []
    for entry in matches:
        for form, _ in entry.quantized:
            if _remove_form(form):
                removed.append(form)
        if entry.kind not in ("hub", "partial", "quantized"):
            _remove_conversion(entry.path)
            removed.append(entry.path)
    gone, kept = _forget_hub({e.name for e in matches} & set(record))
    return Removal(removed + gone, kept)


def _remove_form(path: Path) -> bool:
    """Delete a quantized form kvsnap kept: a regular file directly in ``$KVSNAP_HOME/quantized``."""
    try:
        if path.parent.resolve() != quantized_root().resolve() or not stat.S_ISREG(os.lstat(path).st_mode):
            return False
        path.unlink()
    except OSError:
        return False
    return True


def _remove_conversion(folder: Path) -> None:
    root = models_root()
    with locked(root):
        if not is_conversion(folder):
            raise ModelError(f"{folder}: not a folder kvsnap converted; left alone")
        # Renamed away first, so no reader ever sees half a folder; then deleted (links are not followed).
        trash = Path(tempfile.mkdtemp(prefix=f".{folder.name}.rm-", dir=root))
        os.replace(folder, trash / folder.name)
        fsync_dir(root)
        shutil.rmtree(trash)


def _forget_hub(names: set[str]) -> tuple[list[Path], list[str]]:
    """Drop ``names`` from the hub record; delete a cache folder kvsnap made once nothing recorded uses it."""
    if not names:
        return [], []
    root = models_root()
    removed, kept = [], []
    with locked(root, best_effort=True, timeout=10):
        record = hub_record()
        gone = {n: record.pop(n) for n in names if n in record}
        still_used = {v["cache"] for v in record.values()}
        for name, info in gone.items():
            cache = Path(info["cache"])
            if not info.get("made"):
                kept.append(f"{cache} was in the Hugging Face cache before kvsnap fetched {name}: left there")
            elif info["cache"] in still_used:
                kept.append(f"{cache} also holds another model kvsnap keeps: left there")
            elif _is_hub_cache_folder(cache):
                shutil.rmtree(cache)
                removed.append(cache)
                # huggingface_hub's lock files for the download, made beside the cache folder with it.
                locks = cache.parent / ".locks" / cache.name
                if locks.is_dir() and not locks.is_symlink():
                    shutil.rmtree(locks, ignore_errors=True)
        replace_whole(root / HUB_RECORD, [json.dumps(record, indent=1, sort_keys=True).encode()])
    return removed, kept


def _is_hub_cache_folder(folder: Path) -> bool:
    """A real folder named as the hub cache names a model's (``models--org--name``)."""
    try:
        st = os.lstat(folder)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and folder.name.startswith("models--") and (folder / "snapshots").is_dir()
