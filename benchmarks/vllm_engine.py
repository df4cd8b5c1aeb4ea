"""One vLLM engine in its own process, for tests/integration_vllm/ and benchmarks/vllm_tier.py.

    python benchmarks/vllm_engine.py JOB.json

JOB: ``model`` (a folder), ``store`` (a block store folder, or null for no connector), optional
``extra`` (more ``kv_connector_extra_config``), ``dtype``, ``max_model_len``, ``kv_cache_bytes``, ``threads``,
``block_size`` (vLLM's; its CPU default is 128), ``prefix_caching`` (false: vLLM's own prefix cache
off, so every cached token came from the store), ``in_process`` (scheduler and worker in one process,
as ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the ``uni`` executor do), ``file_size_limit`` (bytes: once
the engine is up, no file this process writes may grow past it, as on a full filesystem), and
``requests``: ``{"ids": [token ids], "max_tokens": n, "salt": cache_salt or null}``, run one after
another, greedy. Prints one marked JSON line (``records`` reads them) when the engine is up
(``{"ready": seconds}``) and one per request as it ends (``text``, ``token_ids``,
``num_cached_tokens``, ``seconds``: wall time of the request), so a caller can act between requests
(kill the engine mid-save, start another).
vLLM starts its engine processes with spawn: everything runs under the ``__main__`` guard.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

MARK = "kvsnap-engine: "  # vLLM logs to stdout too: a caller reads only the lines with this mark


def emit(record: dict[str, Any]) -> None:
    print(MARK + json.dumps(record), flush=True)


def records(stdout: str) -> list[dict[str, Any]]:
    """The records an engine printed, from its whole stdout."""
    return [json.loads(line[len(MARK) :]) for line in stdout.splitlines() if line.startswith(MARK)]


def engine(job: dict[str, Any]) -> Any:
    # One OpenMP thread unless told: on a small shared machine, OpenMP threads spin-waiting on each
    # other make every step several times slower (docs/benchmarks.md).
    os.environ.setdefault("OMP_NUM_THREADS", str(job.get("threads", 1)))
    if job.get("in_process"):
        # Scheduler and worker in this one process: one start of Python and vLLM instead of three.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if job.get("store"):
        kv = KVTransferConfig(
            kv_connector="KvsnapConnector",
            kv_connector_module_path="kvsnap.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"store": job["store"], **job.get("extra", {})},
        )
    return LLM(
        model=job["model"],
        # float32: on a CPU without AVX-512 BF16, bfloat16 matmuls fall back to a slow emulated path.
        dtype=job.get("dtype", "float32"),
        max_model_len=job.get("max_model_len", 2048),
        kv_cache_memory_bytes=job.get("kv_cache_bytes", 1 << 30),
        # Eager: torch.compile would cost minutes at every engine start on a small CPU, and changes no KV layout.
        enforce_eager=True,
        block_size=job.get("block_size"),
        enable_prefix_caching=job.get("prefix_caching"),
        seed=0,
        distributed_executor_backend="uni" if job.get("in_process") else None,
        kv_transfer_config=kv,
    )


def main(path: str) -> None:
    job = json.loads(Path(path).read_text())
    t0 = time.perf_counter()
    llm = engine(job)
    emit({"ready": round(time.perf_counter() - t0, 3)})
    limit = job.get("file_size_limit")
    if limit is not None:
        # Only now: starting vLLM writes temp files. A write past the limit fails with EFBIG (Python
        # ignores SIGXFSZ) where a full disk says ENOSPC: the same failed write() to the code above it.
        import resource

        unlimited = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, unlimited[1]))
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    for i, r in enumerate(job["requests"]):
        prompt = TokensPrompt(prompt_token_ids=r["ids"])
        if r.get("salt"):
            prompt["cache_salt"] = r["salt"]
        params = SamplingParams(temperature=0.0, max_tokens=r.get("max_tokens", 16))
        t = time.perf_counter()
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        seconds = time.perf_counter() - t
        done = out.outputs[0]
        emit(
            {
                "request": i,
                "text": done.text,
                "token_ids": list(done.token_ids),
                "num_cached_tokens": out.num_cached_tokens,
                "prompt_tokens": len(r["ids"]),
                "seconds": round(seconds, 4),
            }
        )
    if limit is not None:
        # Lifted before vLLM shuts down: its shutdown writes a file of its own (torch's process group
        # store) and aborts the process if it cannot.
        resource.setrlimit(resource.RLIMIT_FSIZE, unlimited)


if __name__ == "__main__":
    main(sys.argv[1])
