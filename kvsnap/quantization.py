"""How a quantization is named in a fingerprint, and said when a snapshot is refused for it.

Pure (no torch): the snapshot reader and the store say it too. ``int4``/``int8`` name weights quantized at
load and run on torch's kernels (bfloat16 activations); ``int4-a16``/``int8-a16`` the same weights run on
kvsnap's own kernel (``kvsnap.models.qkernel``: activations quantized to 16 bits in groups of 32), which
computes other KV: a snapshot made by one is refused by the other.
"""

from __future__ import annotations

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
