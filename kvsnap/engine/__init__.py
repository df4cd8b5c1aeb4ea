"""Running a model over a KV cache; torch lives here (and in ``kvsnap.models.load``).

cache          ``KVCache``: the one adapter to transformers' cache API; raw blocks in and out
restorer       restored blocks into the KV buffer (direct on the CPU, a pinned ring to a GPU)
attention      a GQA-aware SDPA registered with transformers (no ``repeat_kv`` copy)
sampling       logits -> token ids, token ids -> streamed text
runner         forward passes with explicit positions; the decode loop
restore        a prefix's KV from a ``.kv`` file or the block store, without the model
verify         is reused KV still right: recompute one restored block and compare
saving         a session into a .kv file (only new blocks encoded)
storing        a session's blocks into the block store, with what made them
chat_template  chat messages -> token ids
results        what a request and a save report
session        ``Session``: restore -> chunked prefill -> decode -> save
background_save  a session's save in a thread, the session left as it is until it is done
"""
