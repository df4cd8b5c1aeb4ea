"""kvsnap's own quantized kernel (kvsnap.models.qkernel, qmatmul.c, kvsnap.models.qstep).

What a user relies on: its products are the weights' products (to 16-bit activations' rounding); a quantized
model on it computes each token's KV and logits the same whatever the chunking, so a resume equals the cold
run bit for bit and skips the prefix; hooks on the layers still see every layer; a weight changed in place
is what runs next; the library it builds is read back only from a private folder; where it cannot run,
torch's kernels do, under another fingerprint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from kernel_paths import PATHS, on_path

from kvsnap.config import SamplingParams
from kvsnap.engine.cache import cache_for
from kvsnap.engine.runner import Runner
from kvsnap.engine.session import Session
from kvsnap.models import fused, load_model, qkernel, quantize, weight_codes


@pytest.fixture
def kernel(kvsnap_home):
    """Built in the test run's own KVSNAP_HOME (so not at collection, which runs before it is set). Only the
    tests of kvsnap's kernel take it; those of torch's kernels run everywhere."""
    if qkernel.library() is None:
        pytest.skip(f"no kernel here: {qkernel.unavailable_reason()}")


IDS = list(range(5, 45))
GREEDY = SamplingParams(temperature=0, max_new_tokens=6)


@pytest.fixture(scope="module")
def int4(tiny_model_dir, kvsnap_home):
    if qkernel.library() is None:
        pytest.skip(f"no kernel here: {qkernel.unavailable_reason()}")
    return {arch: load_model(str(tiny_model_dir(arch)), device="cpu", quantize="int4") for arch in ("llama", "qwen2")}


def _reference(linear: quantize.QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    return x @ linear.dequantized(torch.float32).t() + (0 if linear.bias is None else linear.bias)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 5])
def test_a_product_is_the_weights_product_to_the_activations_rounding(kernel, bits, rows):
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 160), torch.randn(96)
    linear = quantize.QuantizedLinear(weight, bias, bits)
    assert linear.kernel == "a16"
    x = torch.randn(rows, 160)
    got, want = linear(x), _reference(linear, x)
    # 16-bit activations in groups of 32: each product within ~1e-4 of the float one over these weights.
    assert (got - want).abs().max() <= 1e-3 * want.abs().max()
    assert torch.equal(linear(x[:1]), got[:1])  # a row's product does not depend on the rows beside it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_int4_quantization_is_the_reference_one_bit_for_bit(kernel, dtype):
    torch.manual_seed(2)
    weight = (torch.randn(70, 96) * 0.05).to(dtype)
    weight[3, :32] = 0.25  # a constant group: its scale is float16's smallest normal
    weight[5, 32:64] = torch.linspace(-1e-3, 1e-3, 32)  # a scale below float16's normals
    q, d, mins = weight_codes.int4_pairs(weight, 32)
    codes, d2, mins2 = qkernel.quantize_q4(weight, rows_at_once=16)  # several chunks, a partial last one
    assert torch.equal(codes, qkernel.pack_q4(q)) and torch.equal(d2, d) and torch.equal(mins2, mins)


class _Attention(torch.nn.Module):
    """What ``fused.fuse`` looks for: q/k/v/o projections."""

    def __init__(self, widths: tuple[int, int, int], bits: int):
        super().__init__()
        for name, width in zip(("q_proj", "k_proj", "v_proj", "o_proj"), (*widths, 64)):
            setattr(self, name, quantize.QuantizedLinear(torch.randn(width, 64), torch.randn(width), bits))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("widths", [(64, 32, 32), (96, 32, 32), (160, 32, 32), (576, 192, 192), (64, 40, 40)])
def test_a_fused_product_equals_the_separate_ones_bit_for_bit(path, bits, widths):
    """Any part widths (torch's int4 packing lays outputs out in blocks; 40 is no width its packer takes),
    on either kernel path: the decode step's fused product is its parts', or the parts run unfused."""
    torch.manual_seed(1)
    with on_path(path):
        module = _Attention(widths, bits)
    x = torch.randn(1, 64)
    parts = [module.q_proj, module.k_proj, module.v_proj]
    separate = torch.cat([p(x) for p in parts], dim=-1)
    fused.fuse(module)
    together = module.__dict__.get("qkv")
    if widths == (576, 192, 192) or path == "kvsnap" or bits == 8:
        assert together is not None  # where the layout allows, the product is fused
    if together is not None:
        assert torch.equal(together(x), separate)
        assert torch.equal(torch.cat([p(x) for p in parts], dim=-1), separate)  # the parts now view its codes


def test_parts_that_cannot_run_as_one_product_are_refused_not_fused_wrong():
    torch.manual_seed(1)
    with on_path("torch"):
        module = _Attention((64, 32, 32), 4)
    with pytest.raises(ValueError, match="cannot run as one product"):
        fused.FusedQuantized([module.q_proj, module.k_proj, module.v_proj])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_a_decode_step_of_a_quantized_model_computes_what_its_prefill_does(tiny_model_dir, tiny_lm, path, arch):
    """The decode step runs the fused products, a prefill the parts: a token's logits come out alike
    either way, and near the float model's."""
    with on_path(path):
        lm = load_model(str(tiny_model_dir(arch)), device="cpu", quantize="int4")
    assert lm.model.quantization == ("int4-a16" if path == "kvsnap" else "int4")
    runner, cache = Runner(lm), cache_for(lm)
    runner.forward(cache, IDS[:-1], 0)
    stepped = runner.forward(cache, IDS[-1:], len(IDS) - 1).float().reshape(-1)  # a one-token decode step
    whole = Runner(lm).forward(cache_for(lm), IDS, 0).float().reshape(-1)
    plain = tiny_lm(arch)
    float_logits = Runner(plain).forward(cache_for(plain), IDS, 0).float().reshape(-1)
    cosine = torch.nn.functional.cosine_similarity
    assert cosine(stepped, whole, dim=0) > 0.999
    assert cosine(stepped, float_logits, dim=0) > 0.5  # int4 of random weights: 0.6-0.7; wrong products: 0.2-0.3


def _chunked(lm, chunk: int, ids=IDS):
    runner, cache, pos = Runner(lm), cache_for(lm), 0
    while pos < len(ids):
        logits = runner.forward(cache, ids[pos : pos + chunk], pos)
        pos += chunk
    return logits, cache


def _assert_chunking_invariant(lm, ids, chunks) -> None:
    """The logits and every layer's KV after ``ids`` in each chunk size equal those of one whole forward."""
    whole, cache = _chunked(lm, len(ids), ids)
    for chunk in chunks:
        logits, other = _chunked(lm, chunk, ids)
        assert torch.equal(logits, whole), chunk
        for a, b in zip(cache.layers, other.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_token_computes_the_same_kv_and_logits_in_any_chunking(int4, arch):
    lm = int4[arch]
    assert lm.model.quantization == "int4-a16"
    _assert_chunking_invariant(lm, IDS, (1, 3, 7))


def test_a_long_prompt_computes_the_same_kv_and_logits_in_any_chunking(int4):
    """Past the attention's blocks of positions (256 per score task, 64 per pass over the values) and with
    a one-chunk prompt large enough that its rows' scores are taken a tile of rows at a time."""
    lm = int4["llama"]
    ids = [5 + (i * 7) % 50 for i in range(1100)]  # 4 heads x 1,100 positions x 1,100 rows: over one tile
    _assert_chunking_invariant(lm, ids, (1, 257))


@pytest.mark.parametrize("chunk", [1, 7])
def test_a_resume_on_the_kernel_equals_the_cold_run_bit_for_bit_and_skips_the_prefix(
    int4, chunk, forward_counter, tmp_path
):
    lm, path = int4["llama"], tmp_path / "p.kv"
    primer = Session(lm, block_size=8)
    primer.prefill(IDS[:27])
    primer.save(path)
    cold = Session(lm, block_size=8, chunk_size=chunk)
    cold.prefill(IDS)
    cold_logits, cold_tokens = cold.last_logits.clone(), cold.generate(GREEDY).token_ids
    resumed = Session(lm, block_size=8, chunk_size=chunk)
    assert resumed.restore(path, IDS).hit_tokens == 27
    counter = forward_counter(lm)
    resumed.prefill(IDS)
    assert counter.tokens == len(IDS) - 27
    assert torch.equal(resumed.last_logits, cold_logits)
    assert resumed.generate(GREEDY).token_ids == cold_tokens


def test_hooks_on_a_layer_see_every_layer_and_the_result_is_the_same(int4):
    lm = int4["llama"]
    plain, _ = _chunked(lm, 1)
    seen = []
    handles = [
        block.register_forward_hook(lambda module, args, out: seen.append(out.shape)) for block in lm.model.model.layers
    ]
    try:
        hooked, _ = _chunked(lm, 1)
    finally:
        for handle in handles:
            handle.remove()
    assert len(seen) == len(IDS) * lm.config.num_hidden_layers
    assert torch.equal(hooked, plain)  # layer by layer, the same kernels as all layers in one call


@pytest.mark.parametrize("how", ["in place", "replaced"])
@pytest.mark.parametrize("where", ["mlp.down_proj", "self_attn.k_proj"])  # on its own; fused with q and v
def test_a_weight_changed_since_is_what_runs_next(kernel, tiny_model_dir, how, where):
    def change(lm):
        linear = lm.model.model.layers[1].get_submodule(where)
        with torch.no_grad():
            if how == "in place":
                linear.scales.mul_(1.5)
            else:
                linear.scales = linear.scales * 1.5  # a new tensor: the kernel must not keep the old one

    lm = load_model(str(tiny_model_dir("llama")), device="cpu", quantize="int4")
    before, _ = _chunked(lm, 1)
    change(lm)
    after, _ = _chunked(lm, 1)
    fresh = load_model(str(tiny_model_dir("llama")), device="cpu", quantize="int4")
    change(fresh)
    assert not torch.equal(after, before)
    assert torch.equal(after, _chunked(fresh, 1)[0])


def _load_in_child(home, model_dir, env=None) -> dict:
    code = (
        "import json, sys; from kvsnap.models import load_model, qkernel; "
        f"lm = load_model({str(model_dir)!r}, device='cpu', quantize='int4'); "
        "print(json.dumps({'q': lm.model.quantization, 'why': qkernel.unavailable_reason()}))"
    )
    ran = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "KVSNAP_HOME": str(home), **(env or {})},
        timeout=300,
    )
    assert ran.returncode == 0, ran.stderr
    return json.loads(ran.stdout.strip().splitlines()[-1])


def test_a_library_in_a_folder_others_may_write_is_never_loaded(kernel, tiny_model_dir, tmp_path):
    home = tmp_path / "home"
    (home / "kernels").mkdir(parents=True)
    (home / "kernels").chmod(0o777)
    got = _load_in_child(home, tiny_model_dir("llama"))
    assert got["q"] == "int4" and "not a private folder" in got["why"]  # torch's kernels ran instead
    assert not list((home / "kernels").iterdir())


def test_a_link_planted_at_the_library_name_is_replaced_not_followed(kernel, tiny_model_dir, tmp_path):
    home, victim = tmp_path / "home", tmp_path / "victim.so"
    victim.write_bytes(b"not a library")
    first = _load_in_child(home, tiny_model_dir("llama"))
    built = next((home / "kernels").glob("qmatmul-*.so"))
    assert first["q"] == "int4-a16" and oct(built.stat().st_mode & 0o777) == "0o600"
    built.unlink()
    built.symlink_to(victim)
    again = _load_in_child(home, tiny_model_dir("llama"))
    assert again["q"] == "int4-a16"
    assert not built.is_symlink() and victim.read_bytes() == b"not a library"


def test_without_the_kernel_torch_runs_it_and_says_why(tiny_model_dir, tmp_path):
    got = _load_in_child(tmp_path / "home", tiny_model_dir("llama"), {"KVSNAP_QKERNEL": "0"})
    assert got == {"q": "int4", "why": "KVSNAP_QKERNEL=0"}


def test_a_snapshot_made_on_the_kernel_is_refused_on_torchs(int4, tiny_model_dir, tmp_path):
    path = tmp_path / "a16.kv"
    s = Session(int4["llama"], block_size=8)
    s.prefill(IDS)
    s.save(path)
    code = (
        "import sys; from kvsnap.models import load_model; from kvsnap.engine.session import Session; "
        f"lm = load_model({str(tiny_model_dir('llama'))!r}, device='cpu', quantize='int4'); "
        f"Session(lm, block_size=8).restore({str(path)!r}, list(range(5, 45)))"
    )
    env = {**os.environ, "KVSNAP_HOME": str(tmp_path / "home"), "KVSNAP_QKERNEL": "0"}
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert ran.returncode != 0
    assert "weights quantized int4-a16, not int4" in ran.stderr and "C compiler" in ran.stderr


def test_a_library_at_the_name_that_lacks_an_entry_point_falls_back_to_torch(tiny_model_dir, tmp_path):
    home = tmp_path / "home"
    assert _load_in_child(home, tiny_model_dir("llama"))["q"] == "int4-a16"
    built = next((home / "kernels").glob("qmatmul-*.so"))
    # The right version number, and nothing else: what another build, or a planted file, may be.
    source = tmp_path / "partial.c"
    source.write_text(f"int kv_abi_version(void) {{ return {qkernel.ABI_VERSION}; }}\n")
    made = subprocess.run(["cc", "-shared", "-fPIC", str(source), "-o", str(built)], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    built.chmod(0o600)
    got = _load_in_child(home, tiny_model_dir("llama"))
    assert got["q"] == "int4" and "lacks kv_quantize_rows" in got["why"]  # torch's kernels, no traceback


def test_cc_with_arguments_is_a_compiler_command_line(tiny_model_dir, tmp_path):
    got = _load_in_child(tmp_path / "home", tiny_model_dir("llama"), {"CC": "cc -DKVSNAP_UNUSED=1"})
    assert got == {"q": "int4-a16", "why": None}
    missing = _load_in_child(tmp_path / "home2", tiny_model_dir("llama"), {"CC": "no-such-cc -O2"})
    assert missing["q"] == "int4" and missing["why"] == "no C compiler (no-such-cc is not on PATH)"
