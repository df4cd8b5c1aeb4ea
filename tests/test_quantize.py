"""Weights quantized at load (``--quantize``, kvsnap.models.quantize): int8 and int4 models are models of
their own. A resume over them must equal their own cold run and skip the prefix; their fingerprints must
differ from the float model's and from each other; a snapshot made with one quantization is refused, and
explained, by another.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from cli_helpers import kvsnap
from kernel_paths import PATHS, on_path

from kvsnap import quantization
from kvsnap.config import SamplingParams
from kvsnap.engine.cache import cache_for
from kvsnap.engine.prepare import forward_kind, start_packing
from kvsnap.engine.runner import Runner
from kvsnap.engine.session import Session
from kvsnap.errors import ConfigError, SnapshotError
from kvsnap.models import load_model, quantize

GREEDY = SamplingParams(temperature=0, max_new_tokens=6)
IDS = list(range(5, 45))


@pytest.fixture(scope="module")
def quantized(tiny_model_dir):
    """``quantized(mode, arch="llama", path=None)``: the tiny model loaded with ``--quantize mode``, once per
    module; ``path`` (``tests/kernel_paths.py``) picks the kernels, None: what this machine has."""
    loaded = {}

    def get(mode: str, arch: str = "llama", path: str | None = None):
        if (mode, arch, path) not in loaded:
            with on_path(path) if path else contextlib.nullcontext():
                loaded[mode, arch, path] = load_model(str(tiny_model_dir(arch)), device="cpu", quantize=mode)
        return loaded[mode, arch, path]

    return get


def _chunked(lm, ids: list[int], chunk: int):
    runner, cache = Runner(lm), cache_for(lm)
    for pos in range(0, len(ids), chunk):
        logits = runner.forward(cache, ids[pos : pos + chunk], pos)
    return logits, cache


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_token_computes_the_same_kv_and_logits_in_any_chunking_on_either_kernel(quantized, path, mode, arch):
    """Torch's kernels round every product's input to bfloat16: the attention's few-ulp differences
    between chunk sizes would become whole bfloat16 ulps there, so that path runs batch-invariant."""
    lm = quantized(mode, arch, path)
    ids = [5 + (i * 7) % 50 for i in range(100)]
    whole, cache = _chunked(lm, ids, len(ids))
    for chunk in (1, 7, 33):
        logits, other = _chunked(lm, ids, chunk)
        assert torch.equal(logits, whole), chunk
        for a, b in zip(cache.layers, other.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), chunk


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("chunk", [1, 7])
def test_a_quantized_resume_equals_its_own_cold_run_and_skips_the_prefix(
    quantized, path, mode, chunk, forward_counter, tmp_path
):
    """Primed in one forward, resumed and run cold in chunks of another size: bit for bit, on either kernel."""
    lm = quantized(mode, path=path)
    prefix, path = IDS[:27], tmp_path / "p.kv"
    primer = Session(lm, block_size=8)
    primer.prefill(prefix)
    primer.save(path)

    cold = Session(lm, block_size=8, chunk_size=chunk)
    cold.prefill(IDS)
    cold_logits, cold_tokens = cold.last_logits.clone(), cold.generate(GREEDY).token_ids

    resumed = Session(lm, block_size=8, chunk_size=chunk)
    assert resumed.restore(path, IDS).hit_tokens == len(prefix)
    counter = forward_counter(lm)
    plan, seen = resumed.prefill(IDS)
    assert counter.tokens == seen == len(IDS) - len(prefix)
    assert counter.calls == math.ceil((len(IDS) - len(prefix)) / chunk) == len(plan.chunks)
    assert torch.equal(resumed.last_logits, cold_logits)
    assert resumed.generate(GREEDY).token_ids == cold_tokens


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_linear_runs_quantized_and_the_weights_shrink(quantized, arch):
    plain, int8, int4 = (quantized(m, arch) for m in ("none", "int8", "int4"))
    assert (plain.quantization, int8.quantization, int4.quantization) == ("none", "int8", "int4")
    for lm, bits in ((int8, 8), (int4, 4)):
        layers = [m for m in lm.model.modules() if isinstance(m, quantize.QuantizedLinear)]
        assert len(layers) == 7 * lm.config.num_hidden_layers + 1  # q k v o gate up down, and the lm_head
        assert {m.bits for m in layers if m is not lm.model.lm_head} == {bits}
        assert not any(p.dtype == torch.float32 and p.dim() == 2 for p in lm.model.parameters())
    sizes = [quantize.weight_bytes(lm.model) for lm in (plain, int8, int4)]
    assert sizes[0] > 3 * sizes[1] and sizes[1] > sizes[2]
    assert forward_kind(int4).startswith("native forward, int4 weights on ")  # kvsnap's kernel, or torch's: why
    assert not start_packing(int4)  # the quantized kernels run them, not oneDNN's packed float product


def test_quantized_logits_stay_near_the_float_ones(quantized):
    ids = torch.tensor([IDS])
    with torch.inference_mode():
        logits = {m: quantized(m).model(ids).logits[0].float() for m in ("none", "int8", "int4")}
    spread = logits["none"].std()
    assert (logits["int8"] - logits["none"]).abs().mean() < 0.05 * spread
    assert (logits["int4"] - logits["none"]).abs().mean() < 0.5 * spread
    assert not torch.equal(logits["int4"], logits["int8"])


def test_the_fingerprint_differs_by_quantization_and_a_float_model_keeps_its_own(quantized, tiny_model_dir):
    prints = {m: quantized(m).fingerprint for m in ("none", "int8", "int4")}
    assert len(set(prints.values())) == 3
    assert prints["none"] == load_model(str(tiny_model_dir("llama")), device="cpu").fingerprint
    # The name says which kernels ran it: kvsnap's own (-a16) where it builds, else torch's.
    assert quantized("int4").fingerprint_parts["quantization"] == quantized("int4").model.quantization
    assert quantized("int4").model.quantization in ("int4", "int4-a16")
    assert "quantization" not in quantized("none").fingerprint_parts
    # auto keeps a GGUF's class; a folder that is no GGUF conversion stays float.
    assert load_model(str(tiny_model_dir("llama")), device="cpu", quantize="auto").fingerprint == prints["none"]


def test_a_snapshot_made_with_int4_is_refused_by_a_float_run_naming_the_quantization(quantized, tmp_path):
    path = tmp_path / "int4.kv"
    s = Session(quantized("int4"), block_size=8)
    s.prefill(IDS)
    s.save(path)
    int4, int8 = quantized("int4").model.quantization, quantized("int8").model.quantization
    with pytest.raises(SnapshotError, match=f"weights quantized {int4}, not none"):
        Session(quantized("none"), block_size=8).restore(path, IDS)
    with pytest.raises(SnapshotError, match=f"weights quantized {int4}, not {int8}"):
        Session(quantized("int8"), block_size=8).restore(path, IDS)
    assert Session(quantized("int4"), block_size=8).restore(path, IDS).hit_tokens == len(IDS)


def test_explain_names_the_quantization_as_another_model(quantized, tmp_path):
    path = tmp_path / "int8.kv"
    s = Session(quantized("int8"), block_size=8)
    s.prefill(IDS)
    s.save(path)
    run = Session(quantized("none"), block_size=8, explain=True, on_mismatch="recompute")
    miss = run.run(IDS, SamplingParams(max_new_tokens=0), resume=path).miss
    # A quantized model's KV is float16 (its float model's float32): both are named.
    assert miss["cause"] == "model" and miss["differs"] == ["kv_dtype", "quantization"] and miss["reused_tokens"] == 0
    assert f"weights quantized {quantized('int8').model.quantization}, not none (--quantize)" in miss["why"]
    assert "KV dtype: float16, not float32" in miss["why"]


def test_run_quantize_saves_and_resumes_and_a_float_resume_is_refused(tiny_model_dir, tmp_path):
    model, snap = str(tiny_model_dir("llama")), tmp_path / "q.kv"
    args = ["run", "--model", model, "--device", "cpu", "--block-size", "8", "--temperature", "0", "--json"]
    prompt = ["--prompt", "Once upon a time there was a small cache that kept every key."]
    first = kvsnap(*args, *prompt, "--quantize", "int4", "--max-new-tokens", "0", "--save", snap)
    assert first.returncode == 0, first.stderr
    # --reuse load: the cost model may prefer recomputing so short a prefix on some machines.
    again = kvsnap(*args, *prompt, "--quantize", "int4", "--max-new-tokens", "3", "--resume", snap, "--reuse", "load")
    assert again.returncode == 0, again.stderr
    assert '"hit_tokens": 0' not in again.stdout
    refused = kvsnap(*args, *prompt, "--max-new-tokens", "3", "--resume", snap, "--reuse", "load")
    assert refused.returncode == 1 and "quantized int4" in refused.stderr
    bad = kvsnap(*args, *prompt, "--quantize", "int3")
    assert bad.returncode == 1 and "unknown quantization 'int3'" in bad.stderr


@pytest.mark.parametrize(
    ("types", "expected"),
    [(["Q4_1"] * 5 + ["Q6_K"], "int4"), (["Q8_0"] * 3, "int8"), (["F16", "F32"], "none"), (["Q5_K", "Q6_K"], "int4")],
)
def test_auto_keeps_the_class_of_a_gguf(types, expected):
    assert quantization.class_of_gguf_types(types) == expected
    assert quantization.resolve("auto", expected) == expected
    assert quantization.resolve("int8", expected) == "int8"
    assert quantization.resolve("auto", None) == "none"
    with pytest.raises(ConfigError):
        quantization.resolve("int2", None)


def test_int4_codes_read_back_through_the_kernels_layout():
    weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
    layer = quantize.QuantizedLinear(weight, None, bits=4)
    # Each group's codes span 0..15: the dequantized weight is within half a step of the float one.
    step = (weight.reshape(48, 2, 32).amax(2) - weight.reshape(48, 2, 32).amin(2)) / 15
    error = (layer.dequantized(torch.float32) - weight).abs().reshape(48, 2, 32).amax(2)
    assert bool((error <= step * 0.5 + 0.02).all())
    odd = quantize.QuantizedLinear(torch.randn(8, 40), None, bits=4)
    assert odd.bits == 8  # 40 inputs are no whole number of groups: kept in int8


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_quantized_model_keeps_its_kv_in_float16_and_its_snapshots_hold_half_the_bytes(quantized, mode, tmp_path):
    lm, plain = quantized(mode), quantized("none")
    assert (lm.layout.dtype, plain.layout.dtype) == ("float16", "float32")
    assert lm.fingerprint_parts["kv_dtype"] == "float16"
    s = Session(lm, block_size=8)
    s.prefill(IDS)
    assert all(layer.keys.dtype == torch.float16 for layer in s.cache.layers)
    written = s.save(tmp_path / "q.kv")
    f = Session(plain, block_size=8)
    f.prefill(IDS)
    float_written = f.save(tmp_path / "f.kv")
    per_token = 2 * lm.layout.num_layers * lm.layout.num_kv_heads * lm.layout.head_dim * 2  # K and V, 2 bytes
    assert written.kv_bytes == per_token * len(IDS) == float_written.kv_bytes // 2
    # The float16 cache is the one the model computed with: restored, it continues as the live session does.
    again = Session(lm, block_size=8)
    assert again.restore(tmp_path / "q.kv", IDS + [7]).hit_tokens == len(IDS)
    for a, b in zip(again.cache.layers, s.cache.layers):
        assert torch.equal(a.keys[:, :, : len(IDS)], b.keys) and torch.equal(a.values[:, :, : len(IDS)], b.values)
