"""The architecture as the code states it: imports that run one way and never in a circle, no module
reaching into another's underscored names, torch only where a model runs, and modules that stay small.

Every module of ``kvsnap`` and ``kvsnap_cli`` is read (new modules are covered without being listed);
every import counts, the ones inside functions and under ``TYPE_CHECKING`` included.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"kvsnap": ROOT / "kvsnap", "kvsnap_cli": ROOT / "cli"}

# Imports run one way, from higher to lower: cli -> serve -> engine -> models / store -> format -> the
# pure modules at the top of kvsnap. models and store are siblings: neither imports the other.
LAYERS = {
    "kvsnap_cli": 6,
    "kvsnap.serve": 5,
    "kvsnap.integrations": 5,  # kvsnap inside other engines (vLLM): nothing in kvsnap imports them
    "kvsnap.engine": 4,
    "kvsnap.models": 3,
    "kvsnap.store": 3,
    "kvsnap.format": 2,
}
PURE = 1  # kvsnap's top-level modules: errors, config, types, hashing, prefix, limits, paths, ...

# The modules that may import torch (or transformers) when imported: where a model runs. Everything
# else (bookkeeping, the file format, the store, the server's protocol, the CLI) starts without it, so
# `kvsnap inspect`, `kvsnap store ...` and `--help` never pay for torch.
MAY_IMPORT_TORCH = {
    "kvsnap.engine.arena",
    "kvsnap.engine.cache",
    "kvsnap.engine.calibrate",
    "kvsnap.engine.chat",
    "kvsnap.engine.contents",
    "kvsnap.engine.costs",
    "kvsnap.engine.kv_transfer",
    "kvsnap.engine.restore",
    "kvsnap.engine.runner",
    "kvsnap.engine.sampling",
    "kvsnap.engine.session",
    "kvsnap.engine.snapshot_save",
    "kvsnap.engine.store_save",
    "kvsnap.engine.verify",
    "kvsnap.integrations.vllm",
    "kvsnap.integrations.vllm_pages",
    "kvsnap.models.architecture",
    "kvsnap.models.attention",
    "kvsnap.models.decode_step",
    "kvsnap.models.exact",
    "kvsnap.models.fused",
    "kvsnap.models.gguf_codes",
    "kvsnap.models.native",
    "kvsnap.models.packing",
    "kvsnap.models.qkernel",
    "kvsnap.models.qstep",
    "kvsnap.models.quantized_file",
    "kvsnap.models.quantized_load",
    "kvsnap.models.quantize",
    "kvsnap.models.weight_codes",
}
HEAVY = ("torch", "transformers", "safetensors.torch", "accelerate", "vllm")
MAX_LINES = 400  # one concern per module; past this a module is doing more than one job: split it


@dataclass
class Module:
    name: str
    path: Path
    top_level: set[str] = field(default_factory=set)  # imports that run when the module is imported
    all_imports: set[str] = field(default_factory=set)  # every import, lazy and type-only included
    private_uses: list[str] = field(default_factory=list)  # another module's underscored names it uses


def _modules() -> dict[str, Module]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = Module(".".join(parts), path)
    return found


MODULES = _modules()


def _target(name: str) -> str:
    """The module an imported dotted name lives in: ours (the longest known prefix), else the name."""
    probe = name
    while probe and probe not in MODULES:
        probe = probe.rpartition(".")[0]
    return probe or name


def _analyse(module: Module) -> None:
    tree = ast.parse(module.path.read_text())
    package = module.name if module.path.name == "__init__.py" else module.name.rpartition(".")[0]
    runs_at_import: set[int] = set()  # ids of import nodes outside functions and TYPE_CHECKING

    def walk_top(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                walk_top(node.orelse)
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                runs_at_import.add(id(node))
            for child in ("body", "orelse", "finalbody", "handlers"):
                block = getattr(node, child, None)
                if isinstance(block, list):
                    walk_top(
                        [n for n in block if isinstance(n, ast.stmt)]
                        + [s for h in block if isinstance(h, ast.ExceptHandler) for s in h.body]
                    )

    walk_top(tree.body)
    ours: dict[str, str] = {}  # local name -> our module it is bound to
    for node in ast.walk(tree):
        names: list[tuple[str, str]] = []  # (imported dotted name, local name)
        if isinstance(node, ast.Import):
            names = [(a.name, a.asname or a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                names.append((full if full in MODULES else base, a.asname or a.name))
                if a.name.startswith("_") and not a.name.startswith("__") and _target(base) in MODULES:
                    module.private_uses.append(f"from {base} import {a.name}")
        for dotted, local in names:
            target = _target(dotted)
            if target == module.name:
                continue
            module.all_imports.add(target)
            if id(node) in runs_at_import:
                module.top_level.add(target)
            if target in MODULES and dotted == target:
                ours[local] = target
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in ours
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            module.private_uses.append(f"{node.value.id}.{node.attr}")


for _m in MODULES.values():
    _analyse(_m)


def _layer(name: str) -> int:
    for prefix in sorted(LAYERS, key=len, reverse=True):
        if name == prefix or name.startswith(prefix + "."):
            return LAYERS[prefix]
    return PURE


def _group(name: str) -> str:
    for prefix in LAYERS:
        if name == prefix or name.startswith(prefix + "."):
            return prefix
    return "kvsnap"


def test_every_module_is_seen():
    """The checks below read the tree itself: a new module is covered without being listed."""
    assert {"kvsnap", "kvsnap.engine.session", "kvsnap_cli.main", "kvsnap.store.store"} <= set(MODULES)
    assert all(m.all_imports for m in MODULES.values() if m.path.name != "__init__.py" and m.path.stat().st_size > 2000)


def test_imports_run_one_way():
    upward = [
        f"{m.name} -> {t}"
        for m in MODULES.values()
        for t in sorted(m.all_imports)
        if t in MODULES and _group(t) != _group(m.name) and _layer(t) >= _layer(m.name)
    ]
    assert upward == []


def test_no_import_cycles():
    """Not even one that only type checkers or a lazy import would close."""
    graph = {name: {t for t in m.all_imports if t in MODULES} for name, m in MODULES.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for name in graph:
        if name not in index:
            visit(name)
    assert cycles == []


def test_no_module_reaches_into_another_modules_private_names():
    assert {m.name: m.private_uses for m in MODULES.values() if m.private_uses} == {}


def test_library_never_imports_the_cli_or_typer():
    bad = {
        m.name: sorted(t for t in m.all_imports if t.split(".")[0] in ("kvsnap_cli", "typer", "rich"))
        for m in MODULES.values()
        if m.name.split(".")[0] == "kvsnap"
    }
    assert {k: v for k, v in bad.items() if v} == {}


def test_torch_is_imported_only_where_a_model_runs():
    """What each module imports when it is imported, followed through our own modules."""
    heavy = {}
    for name in MODULES:
        seen, todo = set(), [name]
        while todo:
            current = todo.pop()
            if current in seen:
                continue
            seen.add(current)
            if current in MODULES:
                todo.extend(MODULES[current].top_level)
                # Importing a.b.c runs the packages a and a.b first.
                parent = current.rpartition(".")[0]
                if parent in MODULES:
                    todo.append(parent)
        reached = sorted(t for t in seen if t.startswith(HEAVY) or t in HEAVY)
        if reached and name not in MAY_IMPORT_TORCH:
            heavy[name] = reached
    assert heavy == {}


def test_the_list_of_torch_modules_holds_only_modules_that_exist():
    assert set(MODULES) >= MAY_IMPORT_TORCH


def test_only_the_vllm_connector_imports_vllm():
    """Every import, lazy ones included: nothing else in kvsnap or its CLI can pull vLLM in (where vLLM
    is installed tests/integration_vllm/test_imports.py checks ``import kvsnap`` itself)."""
    importers = sorted(m.name for m in MODULES.values() if any(t.split(".")[0] == "vllm" for t in m.all_imports))
    assert importers == ["kvsnap.integrations.vllm"]


@pytest.mark.parametrize(
    "module",
    ["kvsnap", "kvsnap_cli.main", "kvsnap_cli.app", "kvsnap.engine.describe", "kvsnap.store", "kvsnap.integrations"],
)
def test_entry_points_start_without_torch(module):
    """The same in a fresh interpreter, third-party imports included."""
    code = f"import sys, {module}; print(','.join(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "", f"importing {module} imported {out.stdout.strip()}"


def test_no_module_grows_past_the_limit():
    sizes = {m.path.relative_to(ROOT).as_posix(): len(m.path.read_text().splitlines()) for m in MODULES.values()}
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


SCRIPTS = sorted([*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "examples").rglob("*.py")])


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_name_a_script_takes_from_kvsnap_exists(script):
    """Benchmarks and examples run outside the suite's imports: a name moved in kvsnap must move there too."""
    import importlib.util

    missing = []
    for node in ast.walk(ast.parse(script.read_text())):
        if not (isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES):
            continue
        module = importlib.import_module(node.module)
        for alias in node.names:
            if not hasattr(module, alias.name) and importlib.util.find_spec(f"{node.module}.{alias.name}") is None:
                missing.append(f"{node.module}.{alias.name}")
    assert missing == []
