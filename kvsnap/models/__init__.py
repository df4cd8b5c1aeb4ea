"""Models: which folder a name means, what identifies its KV, and loading it.

resolve          names to folders: the default model, a folder, a .gguf file, a hub name
hub              hub names downloaded with huggingface_hub (progress, resume, offline: the cache only)
hub_answers      what a hub answers a download, checked before huggingface_hub makes paths of it
convert          GGUF files converted once, by content, into standard checkpoints
catalog          what kvsnap keeps under $KVSNAP_HOME/models and /quantized: listing, removing
locate           a snapshot's model folder and tokenizer on this machine, without loading anything
fingerprint      the digests that key every hash chain to one model
load             device, dtype, weights and tokenizer -> ``LoadedModel`` (imports torch when called)
architecture     what a config says about the KV cache: its layout, whether kvsnap takes the model
native_config    which configs the native forward takes (config.json read without transformers)
native           a plain-torch Llama/Mistral/Qwen2 forward on the CPU
decode_step      the native forward's one-token step, in fewer operator calls
attention        kvsnap's GQA-aware SDPA, registered with transformers
packing          the native forward's linear weights reordered for oneDNN
quantize         int8/int4 linears and embedding; a model's modules swapped for them, family by family
quantized_file   a quantized model kept as a file: quantized once, mapped by later loads
quantized_load   a native model quantized: its kept form mapped, or made (and kept)
weight_codes     float weights to integer codes and scales, one layout each (Q8_0, Q4_1, torch's)
gguf_codes       a GGUF's tensor types (cached), its own Q4_0 blocks as kvsnap's int4 codes
plain_tokenizer  a native folder's tokenizer.json on the ``tokenizers`` library
chat_jinja       chat templates rendered on jinja2 alone, in transformers' sandbox
template_bounds  the bounds on one chat template rendering: size, steps, time
"""

from kvsnap.config import DEFAULT_MODEL
from kvsnap.models.fingerprint import fingerprint, fingerprint_of, fingerprint_parts, weights_digest
from kvsnap.models.load import LoadedModel, load_model, load_tokenizer, resolve_device, resolve_dtype
from kvsnap.models.resolve import (
    DEFAULT_PACKAGE,
    INSTALL_COMMAND,
    convert_gguf,
    default_gguf_path,
    is_ready,
    kvsnap_home,
    resolve_model,
)

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_PACKAGE",
    "INSTALL_COMMAND",
    "LoadedModel",
    "convert_gguf",
    "default_gguf_path",
    "fingerprint",
    "fingerprint_of",
    "fingerprint_parts",
    "is_ready",
    "kvsnap_home",
    "load_model",
    "load_tokenizer",
    "resolve_device",
    "resolve_dtype",
    "resolve_model",
    "weights_digest",
]
