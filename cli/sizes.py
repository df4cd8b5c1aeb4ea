"""Sizes as users type them (``200MB``, ``1.5GiB``): budgets on the command line."""

from __future__ import annotations

import re

from kvsnap.errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_size(value: str | int) -> int:
    """``"200MB"``, ``"2GB"``, ``"1.5GiB"`` or a plain byte count -> bytes; ``ConfigError`` otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ConfigError(f"size {value} is negative")
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*", str(value), flags=re.IGNORECASE)
    if m is None:
        raise ConfigError(f"cannot read {value!r} as a size (examples: 200MB, 2GB, 1048576)")
    number, unit, binary = m.groups()
    scale = 1024 ** "kmgt".index(unit.lower()) * 1024 if binary and unit else _UNITS[unit.lower()]
    return int(float(number) * scale)
