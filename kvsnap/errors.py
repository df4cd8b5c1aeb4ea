"""The kvsnap error family.

Everything a user, a file or a model can cause is a ``KvsnapError``; the CLI catches only
this family and prints its one-line message. ``assert`` is kept for internal invariants.
"""

from __future__ import annotations


class KvsnapError(Exception):
    """Base of every error a user can cause or fix."""


class SnapshotError(KvsnapError):
    """A ``.kv`` file is damaged, truncated, foreign or of an unsupported version."""


class SnapshotVersionError(SnapshotError):
    """The file's ``format_version`` is not one this kvsnap reads."""


class SnapshotKeyError(SnapshotError):
    """An encrypted snapshot without its key: none given, or another one."""


class ForeignSnapshotError(SnapshotError):
    """The snapshot was written for another model, dtype, block size or namespace."""


class VerifyError(SnapshotError):
    """Reused KV (a snapshot's or the store's) differs from what the running model computes for it."""


class SaveError(KvsnapError, OSError):
    """A snapshot could not be written (missing folder, no space, permissions). The previous file is intact.

    Also an ``OSError``, so code that handles I/O errors generically still sees it as one.
    """


class StoreError(KvsnapError):
    """A block store is damaged, inconsistent, or asked for something it does not hold."""


class ModelError(KvsnapError):
    """A model cannot be found, installed, converted or is not supported."""


class ChatTemplateError(ModelError):
    """A model's chat template fails on a chat, or its rendering goes past the bounds on its size,
    its steps or its time (a template is the model's author's program, run on every chat)."""


class UnsupportedModelError(ModelError):
    """The model's cache is not a plain full-attention dynamic cache."""


class ConfigError(KvsnapError):
    """A setting (sampling, chunk size, device, dtype, ...) is invalid."""


class ContextFullError(ConfigError):
    """A chat turn does not fit the context: its prompt leaves no room for an answer."""


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]
