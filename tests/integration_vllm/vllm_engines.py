"""Helpers for the tests that run vLLM: the default model as a standard checkpoint, its prompts, and
engines in processes of their own (benchmarks/vllm_engine.py), watched line by line."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "benchmarks" / "vllm_engine.py"
sys.path.insert(0, str(ROOT))

from benchmarks.vllm_engine import MARK  # noqa: E402

# A ~1,000-token prompt (the report's start), a question after it, other text for other prompts.
PROMPT_TOKENS = 1000
SUFFIX = "\nQ: Who is the General Manager?\nA:"
ENGINE_TIMEOUT = 1800  # seconds: generous, an engine start takes minutes on a busy small machine


def real_model_home() -> Path:
    """Where kvsnap's real-model tests keep the converted default model (tests/conftest.py)."""
    return Path(os.environ.get("KVSNAP_TEST_HOME") or Path.home() / ".cache" / "kvsnap-test")


def default_model() -> Path:
    """kvsnap's converted default model (converted now if needed), as a standard checkpoint vLLM loads."""
    from kvsnap import models

    home = real_model_home()
    old = os.environ.get("KVSNAP_HOME")
    os.environ["KVSNAP_HOME"] = str(home)
    try:
        if not models.is_ready(home / "models" / models.DEFAULT_MODEL) and models.default_gguf_path() is None:
            pytest.skip(f"the default model package is not installed; run: {models.INSTALL_COMMAND}")
        folder = models.resolve_model(models.DEFAULT_MODEL)
    finally:
        if old is None:
            os.environ.pop("KVSNAP_HOME", None)
        else:
            os.environ["KVSNAP_HOME"] = old
    return standard_checkpoint(folder, home / "vllm" / folder.name)


def standard_checkpoint(folder: Path, copy: Path) -> Path:
    """``folder`` itself if its tied embedding is stored under its own name, else a copy where it is.

    A converted GGUF may keep the tied embedding as ``lm_head.weight`` only; vLLM's Llama loads
    ``model.embed_tokens.weight`` and would run with an embedding of zeros (token 0 forever).
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    weights = folder / "model.safetensors"
    with safe_open(weights, "pt") as f:
        names = set(f.keys())
        if "model.embed_tokens.weight" in names or "lm_head.weight" not in names:
            return folder
        stamp = json.dumps([weights.stat().st_size, weights.stat().st_mtime_ns])
        if (copy / ".source").is_file() and (copy / ".source").read_text() == stamp:
            return copy
        tensors = {("model.embed_tokens.weight" if n == "lm_head.weight" else n): f.get_tensor(n) for n in names}
    shutil.rmtree(copy, ignore_errors=True)
    copy.mkdir(parents=True)
    for p in folder.iterdir():
        if p.is_file() and p.name != weights.name:
            shutil.copy2(p, copy / p.name)
    save_file(tensors, copy / weights.name, metadata={"format": "pt"})
    (copy / ".source").write_text(stamp)
    return copy


def tokenize(model: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model / "tokenizer.json")).encode(text, add_special_tokens=False).ids


class Engine:
    """``benchmarks/vllm_engine.py`` with ``job`` in a process group of its own; its output is kept
    (``log``) and its records collected as they come (``wait_for``)."""

    def __init__(self, job: dict[str, Any], folder: Path, name: str, wrap: tuple[str, ...] = ()):
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{name}.json"
        path.write_text(json.dumps(job))
        self.name = name
        self.lines: list[str] = []
        self.records: list[dict[str, Any]] = []
        self.ended = False  # its output ended: it exited or was killed
        self._changed = threading.Condition()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
        self.proc = subprocess.Popen(
            [*wrap, sys.executable, str(ENGINE), str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=ROOT,
            start_new_session=True,  # one group: a SIGKILL reaches vLLM's engine processes too
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line)
                if line.startswith(MARK):
                    self.records.append(json.loads(line[len(MARK) :]))
                self._changed.notify_all()
        with self._changed:
            self.ended = True
            self._changed.notify_all()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_for(self, request: int, timeout: float = ENGINE_TIMEOUT) -> dict[str, Any]:
        """The record of request ``request`` (0-based), once the engine printed it."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = [r for r in self.records if r.get("request") == request]
                if found:
                    return found[0]
                if self.ended:
                    raise AssertionError(f"{self.name} ended (exit {self.proc.returncode}):\n{self.log[-6000:]}")
                if time.monotonic() > deadline:
                    self.kill()
                    raise AssertionError(f"{self.name} timed out:\n{self.log[-6000:]}")
                self._changed.wait(1.0)

    def finish(self, timeout: float = ENGINE_TIMEOUT) -> list[dict[str, Any]]:
        """Every record, once the engine exited 0."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.name} timed out:\n{self.log[-6000:]}") from None
        with self._changed:
            self._changed.wait_for(lambda: self.ended, 60)
        assert self.proc.returncode == 0, f"{self.name} exited {self.proc.returncode}:\n{self.log[-6000:]}"
        return list(self.records)

    def kill(self) -> None:
        """SIGKILL the engine and every process it started."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(60)


def files_under(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()}
