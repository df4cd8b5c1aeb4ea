"""Tests that run vLLM itself, with kvsnap's connector: only in the vLLM venv (``bash .ci/setup-vllm``,
then ``.venv-vllm/bin/python -m pytest -q tests/integration_vllm/``; ``.ci/run`` does both). Where vLLM
is not importable (kvsnap's own .venv) nothing here is collected."""

from __future__ import annotations

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("vllm") is not None else ["*.py"]
