"""What a process that runs many forwards (a chat, a server, a batch) prepares once its model is
loaded: packed weights and (a chat, a server: they wait on their user) the chat template's tokenizer,
in the background; the KV memory of a ``ctx_size``, now. A one-shot run prepares none of it: its
single forward would wait for it.
"""

from __future__ import annotations

from kvsnap import limits, quantization
from kvsnap.models.load import LoadedModel


def preload_chat_template(lm: LoadedModel) -> None:
    """Start loading what renders ``lm``'s chat template, in the background: transformers' tokenizer
    behind a ``kvsnap.models.plain_tokenizer`` (a chat or a server renders one soon; nothing to do
    for a transformers tokenizer, which renders it itself)."""
    preload = getattr(lm.tokenizer, "preload", None)
    if preload is not None:
        preload()


def start_packing(lm: LoadedModel) -> bool:
    """Start packing ``lm``'s linear weights for oneDNN in the background (``kvsnap.models.packing``):
    for a process that runs many forwards. Its forwards wait for it. False where nothing is packed."""
    start = getattr(lm.model, "start_packing", None)
    return bool(start is not None and start())


def _kernels(lm: LoadedModel) -> str:
    if str(getattr(lm.model, "quantization", "")).endswith(quantization.KERNEL_SUFFIX):
        return "on kvsnap's kernel"
    if lm.device.type != "cpu":
        return "dequantized per product"
    from kvsnap.models import qkernel

    why = qkernel.unavailable_reason() or "its layers' shapes"
    return f"on torch's kernels ({why})"


def forward_kind(lm: LoadedModel) -> str:
    """What runs ``lm``'s forward, in words: "native forward, packed weights", "transformers forward"."""
    packing = getattr(lm.model, "packing", None)
    if lm.quantization != "none":
        return f"{lm.backend} forward, {lm.quantization} weights {_kernels(lm)}"
    if packing is None:
        return f"{lm.backend} forward"
    if packing.error is not None:
        return f"{lm.backend} forward, weights not packed ({packing.error})"
    if not packing.done:
        return f"{lm.backend} forward, packing weights"
    # Where one-row products (a decode step, the lm_head) measured faster over the plain weights.
    unpacked = [name for name, on in zip(("layers", "lm_head"), packing.one_row_packed or ()) if not on]
    plain = f" (one-row products unpacked: {', '.join(unpacked)})" if unpacked else ""
    return f"{lm.backend} forward, packed weights{plain}"


def reserve_context(lm: LoadedModel) -> bool:
    """Where a context size was asked for (``ctx_size``) on the CPU: allocate and touch a pooled KV
    buffer that holds it now (``kvsnap.engine.arena.warm``), for a process that runs many forwards,
    before its first restore or prefill, which then takes it. False where nothing was reserved.

    Not in a thread: a first request racing the touching would allocate a second buffer of its own."""
    if lm.context_source != limits.ASKED_CONTEXT or lm.max_positions is None or lm.device.type != "cpu":
        return False
    from kvsnap.engine import arena
    from kvsnap.models.architecture import TORCH_DTYPES

    layout = lm.layout
    dtype = TORCH_DTYPES[layout.dtype]
    return arena.warm(layout.num_layers, layout.num_kv_heads, layout.head_dim, lm.max_positions, dtype)


def preload(lm: LoadedModel) -> None:
    """What a chat or a server starts in the background once the model is loaded, while it waits on its
    user: the chat template's tokenizer and packed weights. (A batch has no such wait: it only packs,
    ``start_packing``; a background import would slow its first job.)"""
    preload_chat_template(lm)
    start_packing(lm)
