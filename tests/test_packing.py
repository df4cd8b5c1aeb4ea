"""kvsnap.models.packing: the native forward's linear weights reordered for oneDNN, for processes that run
many forwards (chat, serve, run --batch).

The packed model must be the same model to float rounding (logits and KV), a resume over it must
still equal a cold run and skip the prefix, every forward after ``start_packing`` must run packed
(none half-way), and a packing that fails or is not possible must leave the model exactly as it was.
"""

from __future__ import annotations

import math

import pytest
import tiny_models
import torch
from exact_diagnosis import cuts, prefill_kv
from test_native import NATIVE_ARCHS, _run

from kvsnap.config import SamplingParams
from kvsnap.engine.cache import cache_for
from kvsnap.engine.prepare import forward_kind, start_packing
from kvsnap.engine.runner import Runner
from kvsnap.engine.session import Session
from kvsnap.models import load_model, native, packing

GREEDY = SamplingParams(temperature=0, max_new_tokens=6)
IDS = list(range(3, 25))


@pytest.fixture(autouse=True)
def one_row_packed(monkeypatch):
    """One-row products over the packed weights too, unless a test says otherwise: what runs where is
    then fixed, not the outcome of a timing (``packing.ONE_ROW``)."""
    monkeypatch.setattr(packing, "ONE_ROW", "packed")


def _load(tiny_model_dir, arch: str = "llama", dtype: str = "float32"):
    # Not the shared tiny_lm: a packed model is another model to float rounding.
    return load_model(str(tiny_model_dir(arch)), device="cpu", dtype=dtype)


def _packed(lm) -> list[bool]:
    return [m.packed is not None for m in lm.model.modules() if isinstance(m, native.Linear)]


@pytest.mark.parametrize("arch", NATIVE_ARCHS)
def test_packed_forward_equals_the_unpacked_one(arch, tiny_model_dir):
    plain, packed = _load(tiny_model_dir, arch), _load(tiny_model_dir, arch)
    assert start_packing(packed)
    (a_logits, a_kv), (b_logits, b_kv) = _run(plain, IDS), _run(packed, IDS)
    # Every linear runs packed, the lm_head too (its one row a forward runs on every core so).
    assert all(_packed(packed)) and packed.model.lm_head.packed is not None
    assert packed.model.packing.done and packed.model.packing.error is None
    assert forward_kind(packed) == "native forward, packed weights"
    assert forward_kind(plain) == "native forward"
    for a, b in zip(a_logits, b_logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a_kv, b_kv, rtol=1e-5, atol=1e-5)
    assert start_packing(packed)  # idempotent: the same packing
    # The weights the state dict and the fingerprint see are untouched.
    assert all(torch.equal(a, b) for a, b in zip(plain.model.state_dict().values(), packed.model.state_dict().values()))


def test_a_resume_over_packed_weights_equals_cold_and_skips_the_prefix(tiny_model_dir, forward_counter, tmp_path):
    lm = _load(tiny_model_dir)
    start_packing(lm)
    ids = list(range(5, 45))
    prefix, path = ids[:27], tmp_path / "p.kv"
    primer = Session(lm, block_size=8)
    primer.prefill(prefix)
    primer.save(path)

    cold = Session(lm, block_size=8, chunk_size=7)
    cold.prefill(ids)
    cold_logits, cold_tokens = cold.last_logits.clone(), cold.generate(GREEDY).token_ids

    resumed = Session(lm, block_size=8, chunk_size=7)
    assert resumed.restore(path, ids).hit_tokens == len(prefix)
    counter = forward_counter(lm)
    plan, seen = resumed.prefill(ids)
    assert counter.tokens == seen == len(ids) - len(prefix)
    assert counter.calls == math.ceil((len(ids) - len(prefix)) / 7) == len(plan.chunks)
    torch.testing.assert_close(resumed.last_logits, cold_logits, rtol=0, atol=1e-4)
    assert resumed.generate(GREEDY).token_ids == cold_tokens
    assert all(_packed(lm))


def _count_packed_products(monkeypatch) -> list[torch.dtype]:
    calls, real = [], packing.linear

    def counted(x, packed, bias):
        calls.append(packed.dtype)
        return real(x, packed, bias)

    monkeypatch.setattr(packing, "linear", counted)
    return calls


def test_a_model_cast_or_loaded_after_packing_runs_its_own_weights(tiny_model_dir, monkeypatch):
    """The packed copy is of the weights as they were: after a cast (even back to float32) or an
    in-place load, the forward runs the weights the model has now, and the stale copy is dropped."""
    plain, lm = _load(tiny_model_dir), _load(tiny_model_dir)
    assert start_packing(lm)
    lm.model.packing.wait()
    calls = _count_packed_products(monkeypatch)
    _run(lm, IDS)
    assert calls  # packed products ran
    lm.model.to(torch.bfloat16).to(torch.float32)  # every weight rounded to bfloat16 and back
    plain.model.to(torch.bfloat16).to(torch.float32)
    calls.clear()
    (a_logits, a_kv), (b_logits, b_kv) = _run(plain, IDS), _run(lm, IDS)
    assert not calls and not any(_packed(lm))
    for a, b in zip(a_logits, b_logits):
        assert torch.equal(a, b)  # exactly the unpacked model of the rounded weights
    assert torch.equal(a_kv, b_kv)

    fresh = _load(tiny_model_dir)
    assert start_packing(fresh)
    fresh.model.packing.wait()
    layer = fresh.model.model.layers[0].mlp.down_proj
    with torch.no_grad():
        layer.weight.mul_(0)  # loaded in place
    calls.clear()
    _run(fresh, IDS)
    assert layer.packed is None and len(calls) == 4 * (len(_packed(fresh)) - 1)  # that layer alone unpacked


BF16 = pytest.mark.skipif(not packing._native_bf16(), reason="this CPU has no bfloat16 instructions for oneDNN")


@BF16
def test_bfloat16_weights_are_packed_where_the_cpu_has_bfloat16_instructions(
    tiny_model_dir, forward_counter, tmp_path, monkeypatch
):
    """--dtype bfloat16 on an AMX or AVX512-BF16 CPU: the same model to bfloat16 rounding, and a resume
    over it still equals a cold run over it and skips the prefix."""
    plain, lm = _load(tiny_model_dir, dtype="bfloat16"), _load(tiny_model_dir, dtype="bfloat16")
    assert start_packing(lm)
    lm.model.packing.wait()
    calls = _count_packed_products(monkeypatch)
    (a_logits, a_kv), (b_logits, b_kv) = _run(plain, IDS), _run(lm, IDS)
    assert all(_packed(lm)) and lm.model.packing.error is None
    assert len(calls) == 4 * len(_packed(lm)) and set(calls) == {torch.bfloat16}  # every product, 4 forwards
    assert {m.packed.dtype for m in lm.model.modules() if isinstance(m, native.Linear)} == {torch.bfloat16}
    for a, b in zip(a_logits, b_logits):
        torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.05)
    torch.testing.assert_close(a_kv.float(), b_kv.float(), rtol=0.05, atol=0.05)

    ids = list(range(5, 45))
    path = tmp_path / "p.kv"
    primer = Session(lm, block_size=8)
    primer.prefill(ids[:27])
    primer.save(path)
    cold = Session(lm, block_size=8)
    cold.prefill(ids)
    resumed = Session(lm, block_size=8)
    assert resumed.restore(path, ids).hit_tokens == 27
    counter = forward_counter(lm)
    resumed.prefill(ids)
    assert counter.tokens == len(ids) - 27
    # Chunks of another length sum in another order: bfloat16's tolerance, not float32's.
    torch.testing.assert_close(resumed.last_logits.float(), cold.last_logits.float(), rtol=0.05, atol=0.05)


def test_weights_are_packed_only_where_it_can_be_done(tiny_model_dir, monkeypatch):
    assert not start_packing(_load(tiny_model_dir, dtype="float16"))  # float32 and bfloat16 only
    assert "float32 or bfloat16" in packing.unsupported_reason(_load(tiny_model_dir, dtype="float16").model)
    monkeypatch.setattr(packing, "_native_bf16", lambda: False)  # an AVX2 CPU: oneDNN would emulate it
    assert not start_packing(_load(tiny_model_dir, dtype="bfloat16"))
    assert "no bfloat16 instructions" in packing.unsupported_reason(_load(tiny_model_dir, dtype="bfloat16").model)
    monkeypatch.setattr(packing, "ENABLED", False)  # KVSNAP_PACK=0
    lm = _load(tiny_model_dir)
    assert not start_packing(lm) and packing.unsupported_reason(lm.model) == "KVSNAP_PACK=0"
    monkeypatch.setattr(packing, "ENABLED", True)
    monkeypatch.setenv("KVSNAP_NATIVE", "0")
    theirs = _load(tiny_model_dir)
    assert theirs.backend == "transformers" and not start_packing(theirs)
    assert forward_kind(theirs) == "transformers forward"


def test_no_forward_sees_a_model_half_packed(tiny_model_dir, monkeypatch):
    """The layers switch all at once, when every weight is packed; a forward started meanwhile waits."""
    import threading

    gate, real_pack, calls = threading.Event(), packing.pack, []

    def slow_pack(weight):
        calls.append(1)
        if len(calls) == 3:  # the probe, then the first layer's weights: hold the rest back
            gate.wait(30)
        return real_pack(weight)

    monkeypatch.setattr(packing, "pack", slow_pack)
    lm = _load(tiny_model_dir)
    assert start_packing(lm)
    while len(calls) < 3:
        threading.Event().wait(0.01)
    assert not any(_packed(lm)) and not lm.model.packing.done  # some weights packed, none switched
    result: dict[str, object] = {}
    forward = threading.Thread(target=lambda: result.setdefault("out", _run(lm, IDS)))
    forward.start()
    forward.join(0.5)
    assert forward.is_alive()  # waiting for the packing, not running on a mix
    gate.set()
    forward.join(30)
    assert "out" in result and all(_packed(lm))


def test_a_tied_lm_head_is_packed_as_a_copy_and_the_embedding_keeps_its_weight(tmp_path):
    # The default model ties its lm_head to the embedding; the tiny models do not, but for this one.
    folder = tiny_models.build_tiny_model(tmp_path / "tied", "llama", tie_word_embeddings=True)
    plain, packed = (load_model(str(folder), device="cpu") for _ in range(2))
    assert packed.model.lm_head.weight is packed.model.model.embed_tokens.weight
    assert start_packing(packed)
    (a_logits, a_kv), (b_logits, b_kv) = _run(plain, IDS), _run(packed, IDS)
    assert all(_packed(packed)) and packed.model.lm_head.weight is packed.model.model.embed_tokens.weight
    for a, b in zip(a_logits, b_logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a_kv, b_kv, rtol=1e-5, atol=1e-5)


def test_a_budget_with_room_for_the_layers_alone_packs_them_alone(tiny_model_dir, monkeypatch):
    lm = _load(tiny_model_dir)
    layers = sum(m.weight.numel() * 4 for m in lm.model.packable_linears())
    monkeypatch.setattr(packing, "MAX_PACKED_BYTES", layers + lm.model.lm_head.weight.numel() * 4 - 1)
    assert start_packing(lm)
    lm.model.packing.wait()
    assert all(_packed(lm)[:-1]) and lm.model.lm_head.packed is None  # the layers gain more than the head


def test_a_packed_copy_over_the_memory_budget_is_not_made(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(packing, "MAX_PACKED_BYTES", 1000)
    lm = _load(tiny_model_dir)
    assert not start_packing(lm) and "over the" in packing.unsupported_reason(lm.model)


@pytest.mark.parametrize("failure", ["raises", "disagrees"])
def test_a_packing_that_fails_leaves_the_model_as_it_was(failure, tiny_model_dir, monkeypatch):
    if failure == "raises":

        def broken_pack(weight):
            raise RuntimeError("no oneDNN here")

        monkeypatch.setattr(packing, "pack", broken_pack)
    else:  # a kernel whose products are wrong must never be used
        monkeypatch.setattr(packing, "linear", lambda x, packed, bias: torch.zeros(1))
    plain, lm = _load(tiny_model_dir), _load(tiny_model_dir)
    assert start_packing(lm)
    a, b = _run(plain, IDS), _run(lm, IDS)
    assert not any(_packed(lm)) and not lm.model.packing.done
    assert ("no oneDNN here" if failure == "raises" else "disagrees") in lm.model.packing.error
    assert "weights not packed" in forward_kind(lm)
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)  # exactly the unpacked model
    assert torch.equal(a[1], b[1])


def test_one_row_products_run_unpacked_where_that_was_chosen(tiny_model_dir, monkeypatch):
    """A decode step (and the lm_head, always one row) over the plain weights, a chunk over the packed
    ones; the lm_head then keeps no packed copy at all. The same model to float rounding."""
    monkeypatch.setattr(packing, "ONE_ROW", "plain")
    plain, lm = _load(tiny_model_dir), _load(tiny_model_dir)
    assert start_packing(lm)
    lm.model.packing.wait()
    assert lm.model.packing.one_row_packed == (False, False)
    assert all(_packed(lm)[:-1]) and lm.model.lm_head.packed is None
    assert forward_kind(lm) == "native forward, packed weights (one-row products unpacked: layers, lm_head)"
    calls = _count_packed_products(monkeypatch)
    runner, cache = Runner(lm), cache_for(lm)
    runner.forward(cache, IDS[:9], 0)
    assert len(calls) == len(_packed(lm)) - 1  # the chunk: every layer's product packed, the lm_head not
    calls.clear()
    runner.forward(cache, IDS[9:10], 9)
    assert not calls  # a decode step: none
    (a_logits, a_kv), (b_logits, b_kv) = _run(plain, IDS), _run(lm, IDS)
    for a, b in zip(a_logits, b_logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a_kv, b_kv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("one_row", ["plain", "auto"])
def test_an_exact_forward_over_packed_weights_stays_batch_invariant(one_row, tiny_model_dir, monkeypatch):
    """Whatever one-row products run over, an exact forward's KV does not depend on the cut: its decode
    step's products are padded to a chunk's shape, so they run over the weights a chunk runs over."""
    monkeypatch.setattr(packing, "ONE_ROW", one_row)
    lm = _load(tiny_model_dir)
    assert start_packing(lm)
    lm.model.packing.wait()
    assert lm.model.packing.done and len(lm.model.packing.one_row_packed) == 2
    ids = list(range(3, 40))
    whole_kv, whole_logits = prefill_kv(lm, ids, [(0, len(ids))], exact=True)
    one_at_a_time_kv, logits = prefill_kv(lm, ids, cuts(len(ids), [1]), exact=True)
    assert torch.equal(whole_kv, one_at_a_time_kv) and torch.equal(whole_logits, logits)
