"""Encryption at rest: the key, AES-256-GCM sealing of byte strings, and keyed names. No torch.

The key is 32 random bytes in a key file (64 hex digits; ``kvsnap keygen FILE`` writes one),
named by ``KVSNAP_KEY_FILE``: never a command-line argument, which every user of the machine can
read in ``ps``. The file must be a regular file its owner alone can read (0600 or 0400); a wider one
is refused. ``SealKey.seal`` gives ``nonce || ciphertext || tag`` (a fresh random 96-bit nonce each
time), bound to the caller's associated data, so a sealed piece cannot be moved to another place or
file; ``open`` refuses a wrong key or any changed byte with ``SealError``. ``key_id`` names a key
without revealing it (an HMAC of a fixed text), so a file can say which key it needs; ``resolve_key``
finds that key (the one given, else ``$KVSNAP_KEY_FILE``'s) for sealed snapshots and stores alike.

What was encrypted stays encrypted: ``save_key`` is the one rule every writer asks (a session's
``.kv`` saves, ``store export``), so a save is sealed with the key asked for, else with the key of
any sealed source its content came from (a sealed ``.kv`` file, an encrypted store); and
``refuse_clear_copy`` keeps content from a sealed source out of a plain store.

``cryptography`` is imported on first use: a command that never seals or opens pays nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from pathlib import Path
from typing import Any

from kvsnap.errors import ConfigError, KvsnapError
from kvsnap.paths import open_regular

KEY_ENV = "KVSNAP_KEY_FILE"
KEY_BYTES = 32  # AES-256
NONCE_BYTES = 12
TAG_BYTES = 16
OVERHEAD = NONCE_BYTES + TAG_BYTES  # what sealing adds to each piece
_KEY_FILE_LIMIT = 4096


class SealError(KvsnapError):
    """A sealed piece that does not open: another key, or a changed byte."""


class KeyResolutionError(KvsnapError):
    """No key to open what was sealed: none given or set, an unreadable key file, or another key.
    Callers raise their own error type with this message (``SnapshotKeyError``, ``StoreError``)."""


class SealKey:
    """An AES-256-GCM key (never printed: ``repr`` shows its id only)."""

    __slots__ = ("_aead", "_key", "key_id", "source")

    def __init__(self, key: bytes, source: str = "") -> None:
        if len(key) != KEY_BYTES:
            raise ConfigError(f"an encryption key is {KEY_BYTES} bytes, not {len(key)}")
        self._key = bytes(key)
        self._aead: Any = None
        self.key_id = hmac.new(self._key, b"kvsnap key id", hashlib.sha256).hexdigest()[:16]
        self.source = source

    def __repr__(self) -> str:
        return f"SealKey(key_id={self.key_id})"

    def _cipher(self) -> Any:
        if self._aead is None:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM

            self._aead = AESGCM(self._key)
        return self._aead

    def seal(self, data: bytes | memoryview, aad: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._cipher().encrypt(nonce, bytes(data), aad)

    def open(self, sealed: bytes | memoryview, aad: bytes) -> bytes:
        """The bytes ``seal`` was given; ``SealError`` when the key or any byte (or ``aad``) differs."""
        from cryptography.exceptions import InvalidTag

        sealed = bytes(sealed)
        if len(sealed) < OVERHEAD:
            raise SealError("too short to be sealed")
        try:
            return self._cipher().decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], aad)
        except InvalidTag:
            raise SealError("fails authentication (another key, or the bytes were changed)") from None

    def name(self, data: bytes, size: int = 16) -> bytes:
        """A keyed digest of ``data``: names derived from content (block hashes) that say nothing
        about the content to anyone without the key."""
        return hmac.new(self._key, b"kvsnap name\x00" + data, hashlib.sha256).digest()[:size]


def write_key_file(path: str | os.PathLike[str]) -> SealKey:
    """A new random key, written to ``path`` (created 0600; an existing file is never replaced)."""
    key = os.urandom(KEY_BYTES)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    except FileExistsError:
        # The old key may be all that opens some files: it is never overwritten.
        raise ConfigError(f"{path}: exists already; kvsnap never overwrites a key file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot create ({exc.strerror or exc})") from None
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, key.hex().encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    return SealKey(key, str(path))


def read_key_file(path: str | os.PathLike[str]) -> SealKey:
    """The key in ``path``: a regular file only its owner can read, holding 64 hex digits."""
    with open_regular(path, error=ConfigError, what="key file") as f:
        mode = os.fstat(f.fileno()).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"{path}: key file is open to other users (mode {stat.S_IMODE(mode):04o}); chmod 600 it")
        data = f.read(_KEY_FILE_LIMIT + 1)
    try:
        key = bytes.fromhex(data.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        key = b""
    if len(key) != KEY_BYTES:
        raise ConfigError(f"{path}: not a kvsnap key file (64 hex digits; kvsnap keygen writes one)")
    return SealKey(key, str(path))


def key_from_env(required: str | None = None) -> SealKey | None:
    """The key of ``$KVSNAP_KEY_FILE``; None when it is unset, unless ``required`` says what needs it
    (then a ``ConfigError`` naming the variable)."""
    path = os.environ.get(KEY_ENV)
    if not path:
        if required is not None:
            raise ConfigError(f"{required} needs a key: set {KEY_ENV} to a key file (kvsnap keygen FILE makes one)")
        return None
    return read_key_file(Path(path).expanduser())


def save_key(asked: SealKey | None, *sources: SealKey | None) -> SealKey | None:
    """The key a save is sealed with: ``asked`` (--encrypt), else the key of the first sealed source
    among ``sources`` (what the saved content was read from); None only when nothing was sealed."""
    if asked is not None:
        return asked
    return next((key for key in sources if key is not None), None)


def refuse_clear_copy(source: SealKey | None, destination: SealKey | None, what: str, error: type[KvsnapError]) -> None:
    """Raise ``error`` when content read from a sealed source (``source``: its key) would be written
    to a plain destination (``destination``: None), which would keep it in the clear."""
    if source is not None and destination is None:
        raise error(f"{what} is encrypted; a plain block store would keep it in the clear (use an encrypted store)")


def resolve_key(key_id: str, key: SealKey | None, *, what: str, other_key: str) -> SealKey:
    """``key``, else ``$KVSNAP_KEY_FILE``'s, if it is the key ``key_id`` names; else
    ``KeyResolutionError``. Its message starts with ``what`` (what is sealed: "encrypted", "STORE:
    encrypted store") and says ``other_key`` ("with another key") when the key is another one, so
    each caller's messages read as its own."""
    if key is None:
        try:
            key = key_from_env()
        except ConfigError as exc:
            raise KeyResolutionError(f"{what}, and the key cannot be read: {exc}") from None
    if key is None:
        raise KeyResolutionError(f"{what} (key {key_id}): set {KEY_ENV} to its key file")
    if key.key_id != key_id:
        raise KeyResolutionError(f"{what} {other_key} (key {key_id}; {KEY_ENV} holds key {key.key_id})")
    return key
