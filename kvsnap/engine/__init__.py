"""Running a model over a KV cache, and everything a session does; torch is imported by the modules
that run the model, not by this package.

assemble         ``open_session``: settings -> a ready ``Session`` (load, prepare, store, cost model)
session          ``Session``: restore -> chunked prefill -> decode -> save
chat             one chat turn over a session: messages in, the answer out, nothing half kept
chat_view        what a chat shows the model once it outgrows the context: the oldest turns leave the view
chat_template    chat messages -> token ids
runner           forward passes with explicit positions; the decode loop
sampling         logits -> token ids, token ids -> streamed text
cache            ``KVCache``: the one adapter to transformers' cache API; raw blocks in and out
arena            the KV buffers, allocated and touched once, reused by later caches
restore          a prefix's KV from a ``.kv`` file or the block store, without the model
kv_transfer      decoded blocks into the KV buffer (directly on the CPU, a pinned ring to a GPU)
verify           is reused KV still right: recompute one restored block and compare
contents         what a session holds, as the writers below read it
encoded          blocks already encoded, kept so the next save does not encode them again
snapshot_save    a session into a ``.kv`` file
store_save       a session's blocks into the block store, with what made them
background_save  a snapshot save in a thread, the session left as it is until it is done
costs            this machine's load-or-recompute cost model: kept, read back, the decision
calibrate        measuring that cost model
prepare          what a long-lived process prepares once its model is loaded
explain          why a prompt reused less than it could: the causes, the ``Miss`` (torch-free)
explain_sources  a miss against a ``.kv`` file, the block store or a session's own tokens (torch-free)
describe         what a snapshot holds and what a prompt would reuse, for ``kvsnap inspect`` (torch-free)
results          what a request and a save report
"""
