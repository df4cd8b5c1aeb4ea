"""Converted models: one conversion per file whatever its path, standard checkpoints any tool loads, folders an
earlier kvsnap converted rewritten in place with the same fingerprint, and ``kvsnap models`` over them."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tiny_models import build_tiny_model
from typer.testing import CliRunner

from kvsnap import models
from kvsnap.config import DEFAULT_MODEL, SamplingParams
from kvsnap.engine.session import Session
from kvsnap.models import catalog, convert, resolve
from kvsnap.models.fingerprint import weights_digest
from kvsnap_cli.main import app

runner = CliRunner()


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KVSNAP_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _earlier_conversion(src: Path, folder: Path) -> Path:
    """``src`` as an earlier kvsnap conversion left it: the tied embedding stored once as ``lm_head.weight``
    (its other name in the file's metadata), no ``architectures`` in config.json, a ready marker."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    folder.mkdir(parents=True)
    convert.save_dequantized(model, folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("architectures", None)
    (folder / "config.json").write_text(json.dumps(config))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, folder / f.name)
    (folder / catalog.READY).write_text(json.dumps({"source": "/gone/model.gguf", "converted_at": 0}))
    return folder


def _names(folder: Path) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_an_earlier_conversion_becomes_a_standard_checkpoint_with_the_same_fingerprint(home, tmp_path):
    from transformers import AutoModelForCausalLM

    src = build_tiny_model(tmp_path / "src", "llama", tie_word_embeddings=True)
    folder = _earlier_conversion(src, catalog.models_root() / DEFAULT_MODEL)
    assert _names(folder) >= {"lm_head.weight"} and "model.embed_tokens.weight" not in _names(folder)
    before = models.load_model(str(folder), device="cpu")  # by path: read as it is
    ids = before.tokenizer("The capital of France is")["input_ids"]
    snapshot = tmp_path / "a.kv"
    primed = Session(before)
    primed.run(ids, SamplingParams(max_new_tokens=0))
    primed.save(snapshot)

    after = models.load_model(DEFAULT_MODEL, device="cpu")  # by name: rewritten first
    names = _names(folder)
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert after.fingerprint == before.fingerprint, "the same weights keep their fingerprint"
    resumed = Session(after).run(ids, SamplingParams(max_new_tokens=0), resume=snapshot)
    assert resumed.hit_tokens == len(ids)
    with torch.no_grad():
        x = torch.tensor([ids])
        assert torch.equal(after.model(x).logits, before.model(x).logits)
        plain, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
        assert torch.equal(plain.eval()(x).logits, before.model(x).logits)
    assert os.stat(folder / "model.safetensors").st_mode & 0o077 == 0
    assert not convert.needs_repair(folder)
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]

    # The marker's word on the digest counts only in kvsnap's own folder: a copy elsewhere hashes to itself.
    copy = shutil.copytree(folder, tmp_path / "copy")
    assert weights_digest(copy) != weights_digest(folder)


def test_a_gguf_is_converted_once_whatever_its_path(home, tmp_path, monkeypatch):
    calls: list[Path] = []

    def fake_convert(gguf: Path, folder: Path, *, progress=None, name=None) -> Path:
        calls.append(gguf)
        folder.mkdir(parents=True)
        (folder / catalog.READY).write_text(json.dumps({"source": str(gguf), "name": name}))
        return folder

    monkeypatch.setattr(resolve, "convert_gguf", fake_convert)
    monkeypatch.setattr(resolve, "default_gguf_path", lambda: None)
    (tmp_path / "a").mkdir()
    gguf = tmp_path / "a" / "model.Q4_0.gguf"
    gguf.write_bytes(b"GGUF" + os.urandom(4096))
    first = resolve.resolve_model(str(gguf))
    monkeypatch.chdir(tmp_path)
    assert resolve.resolve_model("a/model.Q4_0.gguf") == first
    (tmp_path / "link.gguf").symlink_to(gguf)
    assert resolve.resolve_model(str(tmp_path / "link.gguf")) == first
    (tmp_path / "b").mkdir()
    shutil.copy(gguf, tmp_path / "b" / "renamed.gguf")
    assert resolve.resolve_model(str(tmp_path / "b" / "renamed.gguf")) == first
    assert len(calls) == 1
    other = tmp_path / "b" / "other.gguf"
    other.write_bytes(b"GGUF" + os.urandom(4096))
    assert resolve.resolve_model(str(other)) != first
    assert len(calls) == 2


def test_the_default_models_gguf_given_by_path_is_the_default_model(home, tmp_path, monkeypatch):
    gguf = tmp_path / "SmolLM2.gguf"
    gguf.write_bytes(b"GGUF" + os.urandom(4096))
    monkeypatch.setattr(resolve, "default_gguf_path", lambda: gguf)
    default = catalog.models_root() / DEFAULT_MODEL
    default.mkdir(parents=True)
    (default / catalog.READY).write_text("{}")
    copy = tmp_path / "copy.gguf"
    shutil.copy(gguf, copy)
    assert resolve.resolve_model(str(copy)) == default


def test_models_lists_and_removes_only_what_kvsnap_made(home, tmp_path):
    root = catalog.models_root()
    made = root / "model-0123456789abcdef"
    made.mkdir(parents=True)
    (made / catalog.READY).write_text(json.dumps({"name": "/data/model.gguf", "source": "/data/model.gguf"}))
    (made / "model.safetensors").write_bytes(b"\0" * 1000)
    foreign = root / "mine"
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    linked = root / "linked"
    linked.symlink_to(made)

    listed = runner.invoke(app, ["models", "--json"])
    assert listed.exit_code == 0, listed.output
    (entry,) = json.loads(listed.stdout)["models"]
    assert entry["name"] == "/data/model.gguf" and entry["kind"] == "gguf" and entry["bytes"] >= 1000

    for name in ("mine", "linked", "../home"):
        refused = runner.invoke(app, ["models", "rm", name])
        assert refused.exit_code == 1, name
        assert len(refused.stderr.strip().splitlines()) == 1
    assert foreign.is_dir() and linked.is_symlink()

    removed = runner.invoke(app, ["models", "rm", "/data/model.gguf"])
    assert removed.exit_code == 0, removed.output
    assert not made.exists() and foreign.is_dir()
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["linked", "mine"]
