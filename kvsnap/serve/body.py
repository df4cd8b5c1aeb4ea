"""A request body read as JSON with bounded work: a cap on values and on nesting. No torch.

``json.loads`` parses in C and holds the GIL throughout: a body of ten million small values
(``[0,0,0,...]``, even inside a field kvsnap ignores) keeps every other thread of the server, its
event loop included, waiting for seconds, and a body nested ten thousand deep ends in a
``RecursionError``. Here the structure is walked by the standard library's Python scanner, which
counts every value and every level as it goes and stops at ``MAX_VALUES`` or ``MAX_DEPTH`` with a
400, and lets other threads run between values; strings, where a real request's bytes are, are
still scanned in C.
"""

from __future__ import annotations

import json
import json.decoder
import json.scanner
from typing import Any

# A chat of a few thousand messages is some tens of thousands of values; OpenAI's fields nest a few
# levels deep. Far beyond both, yet parsed in well under a second.
MAX_VALUES = 100_000
MAX_DEPTH = 64


class TooLarge(ValueError):
    """A body whose JSON structure is past ``MAX_VALUES`` or ``MAX_DEPTH``."""


class NotStrict(ValueError):
    """NaN or Infinity: Python's json takes them, JSON does not."""


class _Limits:
    """The scanner's context (``json.scanner.py_make_scanner`` reads these attributes): the decoder's
    own parsers, wrapped to count values and levels."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_string = staticmethod(json.decoder.scanstring)

    def __init__(self) -> None:
        self.values = 0
        self.depth = 0
        self.memo: dict[str, str] = {}

    @staticmethod
    def parse_constant(name: str) -> Any:
        raise NotStrict(f"{name} is not a JSON number")

    def _counted(self, scan_once):
        def scan(text: str, idx: int):
            self.values += 1
            if self.values > MAX_VALUES:
                raise TooLarge(f"the request body holds more than {MAX_VALUES:,} JSON values")
            return scan_once(text, idx)

        return scan

    def _deeper(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise TooLarge(f"the request body nests JSON more than {MAX_DEPTH} levels deep")

    def parse_object(self, s_and_end, strict, scan_once, object_hook, object_pairs_hook, memo):
        self._deeper()
        try:
            return json.decoder.JSONObject(
                s_and_end, strict, self._counted(scan_once), object_hook, object_pairs_hook, memo
            )
        finally:
            self.depth -= 1

    def parse_array(self, s_and_end, scan_once):
        self._deeper()
        try:
            return json.decoder.JSONArray(s_and_end, self._counted(scan_once))
        finally:
            self.depth -= 1


def parse_json(body: bytes) -> Any:
    """The JSON value of ``body`` (UTF-8, -16 or -32, as ``json.loads`` takes bytes). ``TooLarge`` past
    the limits; any other ``ValueError`` (``UnicodeDecodeError``, ``json.JSONDecodeError``,
    ``NotStrict``) for a body that is not JSON."""
    text = body.decode(json.detect_encoding(body), "surrogatepass")
    scan = json.scanner.py_make_scanner(_Limits())
    ws = json.decoder.WHITESPACE.match
    start = ws(text, 0).end()
    try:
        value, end = scan(text, start)
    except StopIteration as exc:
        raise json.JSONDecodeError("Expecting value", text, exc.value) from None
    end = ws(text, end).end()
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return value
