"""Where a chat autosaves, and whether it may replace what is there. No torch, no model.

The rule: an autosave never replaces a snapshot whose content the chat does not extend, unless
the user said so. A chat may replace a file only if (a) it is still the very file this chat last
read or wrote (same inode, size and mtime: nobody else saved over it since), and (b) the chat
continues what the file holds: the file's chat messages are the first of the chat's messages, or,
for a file without messages (a document primed by ``run``), its tokens are the first of the chat's
tokens. Messages decide for chats because an earlier answer may re-tokenize differently when the
template renders it again, although the conversation is the same. A file this chat has never
seen is checked by reading its header and tokens (cheap: no KV is read).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvsnap.errors import SnapshotError


@dataclass(frozen=True, slots=True)
class FileStamp:
    """A file's identity as the chat last saw it: a save by anyone else changes it."""

    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> FileStamp | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True, slots=True)
class Conflict:
    """Why replacing ``path`` would lose something, in words a user can act on."""

    path: Path
    reason: str


class AutosaveTarget:
    """One file a chat saves to, and what the chat knows it holds."""

    def __init__(self, path: Path, *, seen: Held | None = None):
        """``seen``: what this chat just read from ``path`` (it resumed it), else None."""
        self.path = path
        self._stamp = FileStamp.of(path) if seen is not None else None
        self._held = seen

    def conflict(self, tokens: Sequence[int], messages: Sequence[dict[str, str]] | None) -> Conflict | None:
        """What replacing the file with a session of ``tokens`` and ``messages`` would lose; None when safe."""
        now = FileStamp.of(self.path)
        if now is None:
            return None  # nothing there (or nothing readable as a file): nothing to lose
        if self._stamp is not None and now != self._stamp:
            return Conflict(self.path, f"{self.path} was changed by another program since this chat read or wrote it")
        held = self._held if self._stamp is not None else Held.read(self.path)
        if held is None:
            return Conflict(self.path, f"{self.path} exists and is not a snapshot this chat can extend")
        if held.messages is not None:
            if list(messages or [])[: len(held.messages)] != list(held.messages):
                turns = sum(1 for m in held.messages if m["role"] == "user")
                return Conflict(self.path, f"{self.path} holds another conversation ({turns} turns)")
        elif tuple(tokens[: len(held.tokens)]) != held.tokens:
            return Conflict(self.path, f"{self.path} holds {len(held.tokens):,} tokens this chat does not continue")
        return None

    def saved(
        self, tokens: Sequence[int], messages: Sequence[dict[str, str]] | None, *, stamp: FileStamp | None = None
    ) -> None:
        """Record that this chat just wrote ``tokens`` and ``messages`` to the file; ``stamp``: the file's
        identity taken right after that write (a save in the background), else it is taken now."""
        self._stamp = stamp if stamp is not None else FileStamp.of(self.path)
        self._held = Held.of(tokens, messages)


@dataclass(frozen=True, slots=True)
class Held:
    """What a snapshot file holds, as far as continuing it goes."""

    tokens: tuple[int, ...]
    messages: tuple[dict[str, str], ...] | None

    @classmethod
    def of(cls, tokens: Sequence[int], messages: Sequence[dict[str, str]] | None) -> Held:
        return cls(tuple(tokens), tuple(dict(m) for m in messages) if messages is not None else None)

    @classmethod
    def read(cls, path: Path) -> Held | None:
        from kvsnap.format.reader import Snapshot

        try:
            with Snapshot(path) as snap:
                return cls.of(snap.tokens, snap.meta.messages)
        except SnapshotError:
            return None


def beside(path: Path) -> Path:
    """The first free ``NAME-2.kv``, ``NAME-3.kv``, ... next to ``path``."""
    for n in range(2, 10_000):
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
        if not os.path.lexists(candidate):
            return candidate
    raise SnapshotError(f"no free file name beside {path}")
