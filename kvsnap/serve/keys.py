"""API keys for ``kvsnap serve``: who may ask, and which namespace each key's cache lives in. No torch.

Every key gets its own namespace salt, derived from the key: a prefix cached for one key never
matches for another, because a hit answers faster than a miss and so would tell one user what
another asked. The salt depends only on the key (and ``--namespace``), so adding or removing other
keys, or restarting, keeps each key's cache.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from pathlib import Path

from kvsnap.errors import ConfigError
from kvsnap.paths import read_bounded
from kvsnap.serve.protocol import ServeError

MAX_KEYS_FILE = 1 << 20
_LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}


class ApiKeys:
    """The keys a server accepts (none: anyone on the machine may ask, in ``namespace``)."""

    def __init__(
        self, keys: list[str] | tuple[str, ...] = (), namespace: str = "", admin_keys: list[str] | tuple[str, ...] = ()
    ):
        for key in (*keys, *admin_keys):
            if not key or key != key.strip() or not key.isprintable():
                raise ConfigError("an API key must be printable text without surrounding spaces")
        if set(keys) & set(admin_keys):
            raise ConfigError("an admin key must differ from every API key")
        self._salts = {key: key_namespace(namespace, key) for key in keys}
        self._admin = [key.encode() for key in admin_keys]
        self.namespace = namespace

    @property
    def required(self) -> bool:
        return bool(self._salts)

    def __len__(self) -> int:
        return len(self._salts)

    def is_admin(self, authorization: str | None, client_host: str | None) -> bool:
        """Whether a request may see the whole server's figures: it carries an admin key, or the
        server takes no API keys (everyone who can reach it is this machine's) and it comes from
        this machine."""
        given = _bearer(authorization).encode("utf-8", "replace")
        if any([hmac.compare_digest(key, given) for key in self._admin]):
            return True
        return not self._salts and client_host is not None and is_loopback(client_host)

    def namespace_for(self, authorization: str | None) -> str:
        """The namespace of the key in an ``Authorization: Bearer KEY`` header; 401 for a missing or
        unknown key when keys are set. Every key is compared in constant time."""
        if not self._salts:
            return self.namespace
        given = _bearer(authorization)
        found = None
        for key, salt in self._salts.items():
            if hmac.compare_digest(key.encode(), given.encode("utf-8", "replace")):
                found = salt
        if found is None:
            what = "no API key given" if not given else "the API key is not valid"
            raise ServeError(
                401,
                f"{what} (send Authorization: Bearer KEY)",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return found


def _bearer(authorization: str | None) -> str:
    """The key of an ``Authorization: Bearer KEY`` header ("" for none)."""
    if authorization:
        scheme, _, value = authorization.strip().partition(" ")
        if scheme.lower() == "bearer":
            return value.strip()
    return ""


def key_namespace(namespace: str, key: str) -> str:
    """The namespace salt of ``key``: a digest, so the key itself is nowhere in the cache's keys."""
    digest = hashlib.blake2b(key.encode(), digest_size=16, person=b"kvsnap-api-key").hexdigest()
    return f"{namespace}#key-{digest}"


def read_keys_file(path: str | os.PathLike[str]) -> list[str]:
    """Keys from a file: one per line; blank lines and lines starting with ``#`` are skipped."""
    data = read_bounded(path, MAX_KEYS_FILE, error=ConfigError, what="API keys file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: API keys file is not UTF-8 text") from None
    keys = [line.strip() for line in text.splitlines()]
    keys = [k for k in keys if k and not k.startswith("#")]
    if not keys:
        raise ConfigError(f"{Path(path)}: API keys file holds no key")
    return keys


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    name = host.strip().strip("[]").lower()
    if name in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything
