"""kvsnap inside other serving engines. Nothing here is imported by ``import kvsnap``: each integration
imports its engine (vLLM for ``kvsnap.integrations.vllm``), which only that engine's process needs."""
