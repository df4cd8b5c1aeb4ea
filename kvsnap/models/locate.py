"""Where a snapshot's model is on this machine, and its tokenizer without transformers: for looking at
snapshots and stores (``kvsnap inspect``, ``store explain``) with no model loaded. Never converts or
downloads anything."""

from __future__ import annotations

from pathlib import Path

from kvsnap.config import DEFAULT_MODEL
from kvsnap.errors import one_line
from kvsnap.models.catalog import kvsnap_home

NO_TOKENIZER_JSON = "tokenizer.json not found"


class LightTokenizer:
    """Encode/decode with a model's ``tokenizer.json``, cheaply."""

    def __init__(self, folder: Path):
        from tokenizers import Tokenizer

        self.folder = folder
        self._fast = Tokenizer.from_file(str(folder / "tokenizer.json"))

    def encode(self, text: str) -> list[int]:
        return list(self._fast.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        return self._fast.decode(ids, skip_special_tokens=False)


def find_tokenizer(model: str, folder_hint: str | None = None) -> LightTokenizer | None:
    """The tokenizer of a snapshot's model if it is on this machine (never converts or downloads)."""
    return locate_tokenizer(model, folder_hint)[0]


def locate_tokenizer(model: str, folder_hint: str | None = None) -> tuple[LightTokenizer | None, str | None]:
    """The tokenizer of a snapshot's model, or ``None`` and why when its folder is here without one.

    ``model`` is the name the snapshot was made with (the default model's alias, a folder, a
    .gguf file, a hub id); ``folder_hint`` the model folder the writer loaded, which snapshots
    record, so models known by another name are found too. The reason is ``None`` when no model
    folder is found at all.
    """
    why = None
    for folder in _candidates(model, folder_hint):
        if not (folder / "tokenizer.json").is_file():  # is_file: a FIFO there would hang the load
            why = f"{NO_TOKENIZER_JSON} in {folder}"
            continue
        try:
            return LightTokenizer(folder), None
        except Exception as exc:  # the tokenizers library raises its own types for a damaged file
            why = f"cannot load {folder / 'tokenizer.json'} ({one_line(exc)})"
    return None, why


def _candidates(model: str, folder_hint: str | None = None) -> list[Path]:
    """Model folders on this machine that ``model`` (or the folder a snapshot recorded) may name."""
    found = [kvsnap_home() / "models" / DEFAULT_MODEL if model == DEFAULT_MODEL else Path(model).expanduser()]
    if folder_hint:
        found.append(Path(folder_hint))
    return [f for f in found if (f / "config.json").is_file()]


def model_folder(model: str, folder_hint: str | None = None) -> Path | None:
    """The folder of ``model`` if it is on this machine (never converts or downloads)."""
    found = _candidates(model, folder_hint)
    return found[0] if found else None
