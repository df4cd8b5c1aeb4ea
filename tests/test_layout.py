"""The architecture as the folder tree shows it: what must stay torch-free, and modules that stay small."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Bookkeeping, the file format, the store and the CLI's file commands must be usable (and fast to
# start) without torch or transformers: `kvsnap inspect` and `kvsnap store ...` never load a model.
TORCH_FREE = [
    "kvsnap",
    "kvsnap.config",
    "kvsnap.types",
    "kvsnap.hashing",
    "kvsnap.prefix",
    "kvsnap.errors",
    "kvsnap.paths",
    "kvsnap.describe",
    "kvsnap.explain",
    "kvsnap.provenance",
    "kvsnap.format",
    "kvsnap.format.codec",
    "kvsnap.format.meta",
    "kvsnap.format.reader",
    "kvsnap.format.writer",
    "kvsnap.format.atomic",
    "kvsnap.format.pool",
    "kvsnap.store",
    "kvsnap.store.index",
    "kvsnap.store.files",
    "kvsnap.store.store",
    "kvsnap.store.interchange",
    "kvsnap.store.closest",
    "kvsnap.models",
    "kvsnap.models.resolve",
    "kvsnap.models.fingerprint",
    "kvsnap.serve",
    "kvsnap.serve.protocol",
    "kvsnap.serve.keys",
    "kvsnap.serve.turns",
    "kvsnap.serve.service",
    "kvsnap_cli.main",
    "kvsnap_cli.app",
    "kvsnap_cli.batch",
    "kvsnap_cli.options",
    "kvsnap_cli.serve",
    "kvsnap_cli.serve_app",
    "kvsnap_cli.store_explain",
]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_imports_no_torch(module):
    code = (
        f"import sys, {module}; "
        "heavy = sorted(m for m in ('torch', 'transformers', 'safetensors.torch') if m in sys.modules); "
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "", f"importing {module} imported {out.stdout.strip()}"


def test_no_library_module_grows_past_the_limit():
    """One concern per module: a file past ~450 lines is doing more than one job; split it."""
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in (ROOT / "kvsnap").rglob("*.py")}
    sizes.update({p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in (ROOT / "cli").glob("*.py")})
    assert {name: n for name, n in sizes.items() if n > 450} == {}
