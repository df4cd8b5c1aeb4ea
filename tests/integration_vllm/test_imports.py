"""``import kvsnap`` never imports vLLM, checked where vLLM is installed (conftest.py collects these
tests only there; in kvsnap's own venv tests/test_layout.py checks the imports as written)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["kvsnap", "kvsnap.store", "kvsnap.integrations", "kvsnap_cli.main"])
def test_importing_kvsnap_does_not_import_vllm(module):
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
