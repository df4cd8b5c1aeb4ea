"""How a quantization is named in a fingerprint, and said when a snapshot is refused for it.

Pure (no torch): the snapshot reader and the store say it too. ``int4``/``int8`` name weights quantized at
load and run on torch's kernels (bfloat16 activations); ``int4-a16``/``int8-a16`` the same weights run on
kvsnap's own kernel (``kvsnap.models.qkernel``: activations quantized to 16 bits in groups of 32), which
computes other KV: a snapshot made by one is refused by the other. ``--quantize``'s modes, and the class a
GGUF's own weights fall in (``auto`` keeps it), are decided here too.
"""

from __future__ import annotations

from kvsnap.errors import ConfigError

KERNEL_SUFFIX = "-a16"


def refusal(theirs: str, ours: str) -> str:
    """Why a snapshot quantized ``theirs`` is another model's KV for a run quantized ``ours``."""
    text = f"weights quantized {theirs}, not {ours} (--quantize)"
    if theirs.removesuffix(KERNEL_SUFFIX) == ours.removesuffix(KERNEL_SUFFIX):
        text += (
            f"; {KERNEL_SUFFIX} is kvsnap's own kernel, which needs an x86-64 CPU with AVX2 and a C compiler"
            " (KVSNAP_QKERNEL=0 turns it off)"
        )
    return text


MODES = ("none", "int8", "int4", "auto")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ConfigError(f"unknown quantization {mode!r} ({', '.join(MODES)})")
    return mode


def resolve(mode: str, gguf_class: str | None) -> str:
    """The quantization a load applies: ``auto`` keeps a GGUF's class (``class_of_gguf_types``), else none."""
    check_mode(mode)
    if mode == "auto":
        return gguf_class or "none"
    return mode


def class_of_gguf_types(type_names: list[str]) -> str:
    """``int4``, ``int8`` or ``none`` for a GGUF whose layer weights are stored in ``type_names``
    (GGML type names: ``Q4_1``, ``Q8_0``, ``F16``, ...): the class most of them fall in."""
    counts = {"int4": 0, "int8": 0, "none": 0}
    for name in type_names:
        counts[_class_of_type(name)] += 1
    return max(counts, key=lambda k: (counts[k], k == "none"))


def _class_of_type(name: str) -> str:
    name = name.upper()
    if name in ("F32", "F16", "BF16", "F64"):
        return "none"
    if name.startswith(("Q6", "Q8")):
        return "int8"
    return "int4"  # Q2-Q5, IQ*, TQ*: 5 bits or fewer
