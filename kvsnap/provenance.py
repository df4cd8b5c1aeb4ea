"""Which software and device made a snapshot's or a stored block's KV. No torch here.

Reused KV is only as right as the code that computed it: a transformers upgrade that changes RoPE
or attention numerics, or another device kind, can make stored KV differ from what the running
model computes. Snapshots record ``made_by`` in their metadata's ``extra`` and store blocks in
their index entry; a resume compares it with the running versions and, when they differ, spot
checks one block (``kvsnap.engine.verify``). Files written before this was recorded have none:
their versions are unknown, which counts as differing.

A ``made_by`` is a small dict of strings (``KEYS``, and ``ENGINE_KEYS`` for KV that a serving engine
computed); the store keeps it as canonical JSON text (``encode``), so block records stay plain
hashable values.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

# "forward": which code ran the model, "native" (kvsnap/models/native.py) or "transformers" (its
# classes); the transformers version is recorded either way (the native forward is checked against it).
KEYS = ("kvsnap", "torch", "transformers", "forward", "device")
# Blocks that vLLM computed (kvsnap/integrations/vllm.py, "forward": "vllm") also name its version and
# attention kernel: those change KV numerics as much as a library version does.
ENGINE_KEYS = ("vllm", "attention")
_ALL_KEYS = KEYS + ENGINE_KEYS
_LIBRARIES = ("kvsnap", "torch", "transformers")
# A version or device name is short; anything longer is damage or hostile, and is dropped.
MAX_VALUE = 200


def parse(value: Any) -> dict[str, str] | None:
    """A recorded ``made_by`` as read from a file or an index (untrusted): the known keys with short
    string values, or None when absent or malformed (then the versions are unknown)."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value else None
        except (ValueError, RecursionError):
            return None
    if not isinstance(value, Mapping):
        return None
    found = {k: value[k] for k in _ALL_KEYS if isinstance(value.get(k), str) and 0 < len(value[k]) <= MAX_VALUE}
    return found or None


def encode(made_by: Mapping[str, str] | None) -> str:
    """Canonical text of a ``made_by`` ("" for unknown): equal records give equal text."""
    clean = parse(dict(made_by)) if made_by else None
    return json.dumps(clean, sort_keys=True, separators=(",", ":")) if clean else ""


def differences(recorded: Mapping[str, str] | str | None, running: Mapping[str, str]) -> list[str]:
    """What differs between the recorded and the running versions, one phrase each; empty when they match.

    Only keys both sides name are compared (a key added later is not a difference); a record that
    is missing altogether is one: the KV was made by software nobody wrote down.
    """
    made = parse(recorded)
    if made is None:
        return ["versions not recorded"]
    return [f"{k} {made[k]} -> {running[k]}" for k in _ALL_KEYS if k in made and k in running and made[k] != running[k]]


def describe(made_by: Mapping[str, str] | str | None) -> str:
    """``kvsnap 0.1.0, torch 2.5.1, transformers 4.57.1 (native forward) on cpu``, or why it cannot be said;
    KV that vLLM computed: ``vLLM 0.32.0 (CPU_ATTN/vec attention), kvsnap 0.1.0, torch 2.13.0 on cpu``."""
    made = parse(made_by)
    if made is None:
        return "not recorded"
    libs = ", ".join(f"{k} {made[k]}" for k in _LIBRARIES if k in made)
    if "vllm" in made:
        attention = f" ({made['attention']} attention)" if "attention" in made else ""
        libs = f"vLLM {made['vllm']}{attention}" + (f", {libs}" if libs else "")
    forward = f" ({made['forward']} forward)" if "forward" in made and "vllm" not in made else ""
    device = f" on {made['device']}" if "device" in made else ""
    return (libs or "unknown versions") + forward + device
