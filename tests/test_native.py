"""kvsnap.models.native: the plain-torch Llama-family forward a new process loads instead of transformers'.

It must be the same model: the same logits and the same KV, chunk by chunk and token by token,
as transformers' own class loaded from the same folder; it must take only what it implements
(anything else loads through transformers) and it must keep transformers' modeling stack out of
the process, which is what it is for.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import ARCHS

from kvsnap.engine.cache import cache_for
from kvsnap.engine.runner import Runner
from kvsnap.models import load_model, native, native_config

NATIVE_ARCHS = ("llama", "qwen2", "mistral")
ROOT = Path(__file__).resolve().parents[1]


def _run(lm, ids: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Logits after a first chunk, a later chunk and two single tokens; then every layer's KV."""
    runner = Runner(lm)
    cache = cache_for(lm)
    cuts = [(0, 9), (9, 20), (20, 21), (21, 22)]
    logits = [runner.forward(cache, ids[a:b], a) for a, b in cuts]
    return logits, cache.span(0, 22)


@pytest.mark.parametrize(("arch", "dtype"), [(a, "float32") for a in NATIVE_ARCHS] + [("llama", "bfloat16")])
def test_native_forward_equals_transformers(arch, dtype, tiny_model_dir, monkeypatch):
    folder = str(tiny_model_dir(arch))
    ours = load_model(folder, device="cpu", dtype=dtype)
    monkeypatch.setenv("KVSNAP_NATIVE", "0")
    theirs = load_model(folder, device="cpu", dtype=dtype)
    assert (ours.backend, theirs.backend) == ("native", "transformers")
    assert type(ours.config).__name__ == "PlainConfig"
    # Llama: the plain tokenizer (tests/test_plain_tokenizer.py), whose transformers tokenizer is theirs.
    tokenizer = ours.tokenizer.full if arch == "llama" else ours.tokenizer
    assert type(tokenizer) is type(theirs.tokenizer)
    ids = list(range(3, 25))
    (a_logits, a_kv), (b_logits, b_kv) = _run(ours, ids), _run(theirs, ids)
    for a, b in zip(a_logits, b_logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    torch.testing.assert_close(a_kv, b_kv, rtol=0, atol=1e-5)
    # The same parameters under the same names: hooks, state dicts and the fingerprint see one model.
    ours_state, theirs_state = ours.model.state_dict(), theirs.model.state_dict()
    assert ours_state.keys() == theirs_state.keys()
    assert all(torch.equal(ours_state[k], theirs_state[k]) for k in ours_state)
    assert ours.fingerprint == theirs.fingerprint and ours.eos_token_ids == theirs.eos_token_ids
    # Without a cache, every position's logits, as transformers' class gives them.
    x = torch.tensor([ids[:7]])
    with torch.inference_mode():
        torch.testing.assert_close(ours.model(x).logits, theirs.model(x).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", sorted(set(ARCHS) - set(NATIVE_ARCHS)))
def test_other_architectures_load_through_transformers(arch, tiny_lm):
    lm = tiny_lm(arch)
    assert lm.backend == "transformers"
    assert native_config.unsupported_reason(lm.config, torch.device("cpu")) == f"model type {arch!r}"


@pytest.mark.parametrize("arch", NATIVE_ARCHS)
def test_the_plain_config_reads_what_transformers_reads(arch, tiny_model_dir):
    """The config.json read without transformers gives the forward, the cache layout and the context
    exactly what transformers' config class gives them."""
    from transformers import AutoConfig

    from kvsnap.models.architecture import layout_of
    from kvsnap.models.load import max_positions_of

    folder = tiny_model_dir(arch)
    raw = json.loads((folder / "config.json").read_text())
    plain, full = native_config.plain_config(raw), AutoConfig.from_pretrained(str(folder))
    assert plain is not None
    assert native._Shape.of(plain) == native._Shape.of(full)
    assert layout_of(plain, torch.float32) == layout_of(full, torch.float32)
    assert max_positions_of(plain) == max_positions_of(full)
    assert native_config.unsupported_reason(plain, torch.device("cpu")) is None
    assert native_config.unsupported_reason(full, torch.device("cpu")) is None


def test_a_config_it_does_not_implement_goes_to_transformers(tiny_model_dir):
    raw = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    linear = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    for change in (
        {"hidden_act": "gelu"},
        {"rope_parameters": linear},
        {"rope_parameters": None, "rope_scaling": linear},
        {"num_key_value_heads": None},
        {"quantization_config": {"quant_method": "bitsandbytes"}},
        {"layer_types": ["sliding_attention", "full_attention"]},
        {"model_type": "phi3"},
        {"hidden_size": 65},
    ):
        assert native_config.plain_config({**raw, **change}) is None, change
    missing = {k: v for k, v in raw.items() if k != "tie_word_embeddings"}
    assert native_config.plain_config(missing) is None
    # Mistral's class defaults to a sliding window: a config.json that does not say "none" is not plain.
    mistral = json.loads((tiny_model_dir("mistral") / "config.json").read_text())
    assert native_config.plain_config({k: v for k, v in mistral.items() if k != "sliding_window"}) is None
    assert native_config.plain_config({**mistral, "sliding_window": 16}) is None

    from transformers import AutoConfig

    full = AutoConfig.from_pretrained(str(tiny_model_dir("llama")))
    gelu = type(full).from_dict({**full.to_dict(), "hidden_act": "gelu"})
    assert native_config.unsupported_reason(gelu, torch.device("cpu")) == "activation 'gelu'"
    assert native_config.unsupported_reason(full, torch.device("meta")) == "device meta"


def test_weights_that_are_not_exactly_its_tensors_load_through_transformers(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(tiny_model_dir("llama"), tmp_path / "extra")
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({**tensors, "model.extra.weight": torch.zeros(2)}, str(folder / "model.safetensors"))
    with pytest.raises(native.NotNative, match="unexpected"):
        config = native_config.plain_config(json.loads((folder / "config.json").read_text()))
        native.load(folder, config, torch.float32, {})
    lm = load_model(str(folder), device="cpu")
    assert lm.backend == "transformers"  # which loads it and ignores the stray tensor, as it always did
    assert not getattr(lm.config, "plain", False)  # with its own config, so the cache is one it takes
    plain = load_model(str(tiny_model_dir("llama")), device="cpu")
    ids = list(range(3, 25))
    torch.testing.assert_close(_run(lm, ids)[0][-1], _run(plain, ids)[0][-1], rtol=0, atol=1e-5)


def test_sharded_weights_load_natively(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tiny_model_dir("llama")
    folder = shutil.copytree(src, tmp_path / "sharded")
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(folder / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, part in halves.items() for n in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    lm = load_model(str(folder), device="cpu")
    assert lm.backend == "native"
    plain = load_model(str(src), device="cpu")
    ids = list(range(3, 25))
    torch.testing.assert_close(_run(lm, ids)[0][-1], _run(plain, ids)[0][-1], rtol=0, atol=1e-5)


def test_kvsnap_native_0_turns_it_off(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("KVSNAP_NATIVE", "0")
    assert load_model(str(tiny_model_dir("llama")), device="cpu").backend == "transformers"


def test_a_native_run_of_a_raw_prompt_never_imports_transformers(tiny_model_dir):
    """What the native forward and the plain tokenizer are for: a new process loads a Llama model and
    answers a raw prompt without importing transformers at all, nor what transformers would pull in
    (its modeling stack's torch._dynamo, its config classes' torch.distributed.tensor and sympy):
    seconds of imports on a slow CPU."""
    code = (
        "import sys\n"
        "from kvsnap.config import SamplingParams\n"
        "from kvsnap.engine.session import Session\n"
        "from kvsnap.models import load_model\n"
        f"lm = load_model({str(tiny_model_dir('llama'))!r}, device='cpu')\n"
        "r = Session(lm).run(lm.tokenizer('The capital of France is')['input_ids'], SamplingParams(max_new_tokens=3))\n"
        "heavy = ('transformers', 'torch._dynamo', 'torch.distributed.tensor', 'sympy')\n"
        "print(lm.backend, type(lm.tokenizer).__name__, [m for m in heavy if m in sys.modules], r.new_tokens)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[-2] == "native PlainTokenizer [] 3"
