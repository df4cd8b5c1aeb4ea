"""A quantized model keeps whatever its family adds around the linears (``kvsnap.models.quantize``).

Quantization swaps a model's linears and embedding for quantized ones; a family's own parts (Gemma's scaled
embedding, Granite's multipliers, soft caps, norm offsets, tied heads) must survive the swap, or the model
answers garbage while every product is right. Each family's quantized logits are compared with its float ones,
teacher-forced over a text: a part that vanished moves them far past what quantization noise does.

The tiny models here are built with a real model's weight scale (0.05, not the 0.25 other tests use to make
attention sharp), so int4's rounding alone keeps the logits close and a lost part stands out.
"""

from __future__ import annotations

import os
import stat

import pytest
import tiny_models
import torch
from torch import nn

from kvsnap.errors import UnsupportedModelError
from kvsnap.models import gguf_codes, load_model, quantize

FAMILIES = (*tiny_models.ARCHS, *tiny_models.SLIDING)
# Granite 3's multipliers (its 2B config), so a quantized forward that dropped one would show it.
OVERRIDES = {
    "granite": {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "logits_scaling": 8.0},
}
MIN_COSINE = {"int8": 0.97, "int4": 0.90}
TEXT = " ".join(tiny_models.CORPUS)


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    base = tmp_path_factory.mktemp("families")

    def get(arch: str):
        folder = base / arch
        if not folder.exists():
            tiny_models.build_tiny_model(folder, arch, initializer_range=0.05, **OVERRIDES.get(arch, {}))
        return folder

    return get


def _logits(lm, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return lm.model(torch.tensor([ids])).logits[0].float()  # [T, vocab], teacher-forced


@pytest.mark.parametrize("arch", FAMILIES)
def test_quantized_logits_follow_the_float_ones_in_every_family(family_dir, arch):
    folder = str(family_dir(arch))
    float_lm = load_model(folder, device="cpu", quantize="none")
    ids = float_lm.tokenizer(TEXT)["input_ids"]
    assert len(ids) > 100
    reference = _logits(float_lm, ids)
    for mode, floor in MIN_COSINE.items():
        lm = load_model(folder, device="cpu", quantize=mode)
        assert any(isinstance(m, quantize.QuantizedEmbedding) for m in lm.model.modules())
        cosine = torch.nn.functional.cosine_similarity(_logits(lm, ids), reference, dim=-1).mean().item()
        assert cosine >= floor, f"{arch} {mode}: logit cosine {cosine:.3f} against the float model"


def test_a_scaled_embedding_keeps_its_scale(family_dir):
    lm = load_model(str(family_dir("gemma3")), device="cpu", quantize="int8")
    embedding = lm.model.get_input_embeddings()
    assert isinstance(embedding, quantize.QuantizedEmbedding)
    assert embedding.embed_scale is not None and embedding.embed_scale.item() == pytest.approx(64**0.5)
    plain = load_model(str(family_dir("llama")), device="cpu", quantize="int8").model.get_input_embeddings()
    assert plain.embed_scale is None


class _ShiftedEmbedding(nn.Embedding):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) + 1.0


class _GatedLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2.0


def _transformers_model(folder: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("KVSNAP_NATIVE", "0")  # transformers' modules, which a model may subclass
    return load_model(folder, device="cpu", quantize="none").model


def test_an_embedding_or_linear_that_does_more_is_refused_and_left_as_it_was(family_dir, monkeypatch):
    model = _transformers_model(str(family_dir("llama")), monkeypatch)
    old = model.model.embed_tokens
    shifted = _ShiftedEmbedding(old.num_embeddings, old.embedding_dim)
    shifted.weight = old.weight
    model.model.embed_tokens = shifted
    with pytest.raises(UnsupportedModelError, match=r"embedding \(_ShiftedEmbedding\) does more than a table lookup"):
        quantize.apply(model, "int8", torch.float32)
    assert model.model.embed_tokens is shifted and isinstance(model.model.layers[0].mlp.up_proj, nn.Linear)

    model = _transformers_model(str(family_dir("llama")), monkeypatch)
    up = model.model.layers[1].mlp.up_proj
    gated = _GatedLinear(up.in_features, up.out_features, bias=False)
    gated.weight = up.weight
    model.model.layers[1].mlp.up_proj = gated
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.1\.mlp\.up_proj \(_GatedLinear\)"):
        quantize.apply(model, "int4", torch.float32)
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.Linear)  # nothing was replaced


@pytest.mark.slow
def test_the_default_models_quantized_answers_agree_with_its_float_ones(real_model_folder):
    """Teacher-forced over a real report, the top token agrees with the float model's at most positions."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "examples" / "report.txt").read_text()
    float_lm = load_model(str(real_model_folder), device="cpu", quantize="none")
    ids = float_lm.tokenizer(text)["input_ids"][:512]
    reference = _logits(float_lm, ids).argmax(-1)
    for mode, floor in (("int8", 0.90), ("int4", 0.80)):
        top = _logits(load_model(str(real_model_folder), device="cpu", quantize=mode), ids).argmax(-1)
        agreement = (top == reference).float().mean().item()
        assert agreement >= floor, f"{mode}: top-1 agreement {agreement:.3f} with the float model"


def _unpermute(w, heads: int):
    # llama.cpp's converter interleaves the two rotary halves of each q/k head's rows; transformers undoes it
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.slow
def test_the_default_models_quantized_weights_are_its_ggufs_own_values_bit_for_bit(real_model_folder):
    """Its Q4_1 layers under int4 and its Q8_0 embedding (shared by the tied lm_head) under both modes: what
    kvsnap multiplies is gguf-py's dequantization of the file's own blocks, bit for bit."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from kvsnap.models import default_gguf_path

    reader = GGUFReader(str(default_gguf_path()))
    tensors = {t.name: t for t in reader.tensors}
    for mode in ("int4", "int8"):
        lm = load_model(str(real_model_folder), device="cpu", quantize=mode)
        assert lm.model.quantization == f"{mode}-a16"
        config = lm.config
        embedding = lm.model.get_input_embeddings()
        token_embd = tensors["token_embd.weight"]
        assert token_embd.tensor_type.name == "Q8_0"
        want = torch.from_numpy(np.ascontiguousarray(dequantize(token_embd.data, token_embd.tensor_type)))
        got = embedding.qweight.float() * embedding.scales.float().repeat_interleave(32, dim=1)
        assert torch.equal(got, want), mode
        if mode != "int4":
            continue  # int8 of a Q4_1 layer is a requantization, not the file's values
        checked, layers = 0, sorted({0, config.num_hidden_layers // 2, config.num_hidden_layers - 1})
        for i in layers:  # a few layers: dequantizing all 210 of its tensors in numpy takes a minute
            for short in gguf_codes.LAYER_NAMES:
                t = tensors[f"blk.{i}.{short}.weight"]
                assert t.tensor_type.name == "Q4_1"
                want = np.ascontiguousarray(dequantize(t.data, t.tensor_type))
                if short in ("attn_q", "attn_k"):
                    heads = config.num_attention_heads if short == "attn_q" else config.num_key_value_heads
                    want = np.ascontiguousarray(_unpermute(want, heads))
                module = lm.model.get_submodule(gguf_codes.module_name(t.name))
                assert torch.equal(module.dequantized(torch.float32), torch.from_numpy(want)), f"{i} {short}"
                checked += 1
        assert checked == 7 * len(layers)


def _with_q4_0_tensors(src, dst, names: set[str]):
    """A copy of the GGUF ``src`` whose tensors ``names`` (Q4_1 there) are requantized to Q4_0 by gguf-py."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize, quantize

    reader = GGUFReader(str(src))
    writer = GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        writer.add_key_value(
            field.name, field.contents(), kind, sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None
        )
    tensors = []
    for t in reader.tensors:
        data, qtype = t.data, t.tensor_type
        if t.name in names:
            data, qtype = quantize(dequantize(t.data, qtype), GGMLQuantizationType.Q4_0), GGMLQuantizationType.Q4_0
        tensors.append((t.name, data, qtype))
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data)
    writer.close()
    return dst


@pytest.mark.slow
def test_a_q4_0_ggufs_own_blocks_are_the_int4_codes_bit_for_bit(tmp_path, monkeypatch):
    """Q4_0 is symmetric: its float values quantized again as Q4_1 would not be its blocks. They are read from
    the file, kept, and mapped by the next load."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from kvsnap.models import default_gguf_path

    names = {"blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_down.weight", "blk.1.attn_v.weight"}
    gguf = _with_q4_0_tensors(default_gguf_path(), tmp_path / "mixed-q4_0.gguf", names)
    monkeypatch.setenv("KVSNAP_HOME", str(tmp_path / "home"))
    said: list[str] = []
    lm = load_model(str(gguf), device="cpu", quantize="int4", progress=said.append)
    assert lm.model.quantization == "int4-a16+q4_0"
    assert any("kept the int4 weights" in line for line in said)
    tensors = {t.name: t for t in GGUFReader(str(gguf)).tensors}
    for name in names:
        t = tensors[name]
        want = np.ascontiguousarray(dequantize(t.data, t.tensor_type))
        short = name.split(".")[2]
        if short in ("attn_q", "attn_k"):
            want = np.ascontiguousarray(_unpermute(want, 9 if short == "attn_q" else 3))
        module = lm.model.get_submodule(gguf_codes.module_name(name))
        assert torch.equal(module.dequantized(torch.float32), torch.from_numpy(want)), name
    again = load_model(str(gguf), device="cpu", quantize="int4")
    assert "mapped" in again.load_timings and again.fingerprint == lm.fingerprint
    ids = torch.tensor([list(range(100, 140))])
    with torch.inference_mode():
        assert torch.equal(again.model(ids).logits, lm.model(ids).logits)


@pytest.mark.slow
def test_a_ggufs_tensor_types_are_read_once_and_asked_again_when_the_file_or_the_cache_changes(tmp_path, monkeypatch):
    """--quantize auto reads a GGUF's types in every new process; gguf-py takes seconds to list them."""
    import shutil

    import gguf as gguf_package

    from kvsnap.models import default_gguf_path

    monkeypatch.setenv("KVSNAP_HOME", str(tmp_path / "home"))
    path = tmp_path / "model.gguf"
    shutil.copyfile(default_gguf_path(), path)
    types = gguf_codes.layer_types(path)
    assert types["blk.0.attn_q.weight"] == "Q4_1" and len(types) == 7 * 30
    (cache,) = (tmp_path / "home" / "digests").glob("gguf-*.json")
    assert stat.S_IMODE(os.lstat(cache).st_mode) == 0o600

    class Refused:
        def __init__(self, *args, **kwargs):
            raise AssertionError("parsed again")

    with monkeypatch.context() as m:
        m.setattr(gguf_package, "GGUFReader", Refused)
        assert gguf_codes.layer_types(path) == types  # from the cache
        cache.write_text('{"stamp": [], "types": "not a dict"}')
        assert gguf_codes.layer_types(path) is None  # a stale cache is not used: it parses, and that is refused
    assert gguf_codes.layer_types(path) == types
    with path.open("r+b") as f:  # the file written: its identity changes, so it is read again
        f.seek(0, 2)
        f.write(b"\0" * 32)
    with monkeypatch.context() as m:
        m.setattr(gguf_package, "GGUFReader", Refused)
        assert gguf_codes.layer_types(path) is None
