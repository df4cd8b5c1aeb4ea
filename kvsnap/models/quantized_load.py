"""A native model quantized: mapped from its kept form, or quantized from its weights and kept.

The order of a quantized load (``kvsnap.models.load`` calls it for the native forward): the kept form
(``kvsnap.models.quantized_file``) when it is sound and this model's; else the float weights mapped, the
file's own Q4_0 blocks where a GGUF's are these weights (``kvsnap.models.gguf_codes``), the rest quantized
one matrix at a time (``kvsnap.models.quantize``), the products fused, and the form kept for the next load.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvsnap.errors import KvsnapError
from kvsnap.models import catalog, gguf_codes, native, qkernel, quantize
from kvsnap.models.fingerprint import weights_digest
from kvsnap.models.fused import fuse
from kvsnap.models.quantized_file import CacheRejected, cached_form, keepable, load, save
from kvsnap.quantization import KERNEL_SUFFIX


def native_model(folder: Path, config, raw_config: dict, dtype, mode: str, aliases: dict[str, str], progress, mark):
    """The native model in ``folder`` quantized ``mode``: mapped from its kept form where that is sound and
    this model's, else quantized from its weights and the form kept for the next load. ``aliases``, ``progress``
    and ``mark`` as ``kvsnap.models.load`` passes them. Raises ``native.NotNative`` for weights the native
    forward does not take."""

    source = catalog.marker(folder).get("source") if catalog.is_conversion(folder) else None
    gguf = Path(source) if mode == "int4" and isinstance(source, str) and gguf_codes.has_q4_0(Path(source)) else None
    name = f"{mode}{KERNEL_SUFFIX}" + (gguf_codes.SUFFIX if gguf is not None else "")
    cached = None
    if qkernel.library() is not None:
        cached = cached_form(folder, weights_digest(folder), mode, name, raw_config, dtype)
        try:
            model = load(cached, native.NativeCausalLM(config), dtype)
            mark("mapped")
            return model
        except CacheRejected as exc:
            if str(exc) != "not made yet":
                progress(f"the kept {mode} form of the model is not used ({exc}); quantizing again")
    model = native.load(folder, config, dtype, aliases, True)
    mark("weights")
    progress(f"quantizing the weights to {mode}")
    given = {}
    if gguf is not None and cached is not None:  # the file's own Q4_0 blocks, where they are these weights
        weights = {
            n: m.weight for n, m in model.named_modules() if isinstance(getattr(m, "weight", None), torch.Tensor)
        }
        heads = {}
        for n in weights:
            if n.endswith(("q_proj", "k_proj")):
                heads[n] = config.num_attention_heads if n.endswith("q_proj") else config.num_key_value_heads
        given = gguf_codes.own_int4_codes(gguf, {n: w for n, w in weights.items() if w.dim() == 2}, heads)
    quantize.apply(model, mode, dtype, given)
    if given:
        model.quantization += gguf_codes.SUFFIX
    fuse(model)  # one product for q/k/v and for gate/up in a decode step
    mark("quantize")
    if cached is not None and keepable(model) and model.quantization == cached.identity["quantization"]:
        try:
            save(model, cached)
            progress(f"kept the {mode} weights for later loads to map: {cached.path}")
        except (OSError, KvsnapError) as exc:
            progress(f"the quantized form is not kept ({exc}); the next load quantizes again")
        mark("keep")
    return model
