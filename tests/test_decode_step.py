"""kvsnap.models.decode_step: a one-token forward of the native model in fewer operator calls.

It must be the same forward bit for bit (logits and KV, float32 and bfloat16, packed weights or not),
it must run for decode steps only (never a prefill chunk, never an exact forward), and a chat's
decode must still continue exactly as a resumed one does.
"""

from __future__ import annotations

import pytest
import torch
from exact_diagnosis import cuts, prefill_kv
from test_native import NATIVE_ARCHS

from kvsnap.config import SamplingParams
from kvsnap.engine.cache import cache_for
from kvsnap.engine.prepare import start_packing
from kvsnap.engine.runner import Runner
from kvsnap.engine.session import Session
from kvsnap.models import decode_step, load_model, packing

GREEDY = SamplingParams(temperature=0, max_new_tokens=8)


def _steps(lm, ids: list[int], first: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Logits of a first chunk of ``first`` tokens and then of every later token alone; every layer's KV."""
    runner, cache = Runner(lm), cache_for(lm)
    logits = [runner.forward(cache, ids[:first], 0)]
    logits += [runner.forward(cache, ids[i : i + 1], i) for i in range(first, len(ids))]
    return logits, cache.span(0, len(ids))


@pytest.fixture
def counted_steps(monkeypatch) -> list[int]:
    """How many forwards ran through ``decode_step.hidden`` (one entry per call)."""
    calls, real = [], decode_step.hidden

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(decode_step, "hidden", counted)
    return calls


@pytest.mark.parametrize(("arch", "dtype"), [(a, "float32") for a in NATIVE_ARCHS] + [("llama", "bfloat16")])
def test_a_decode_step_is_the_general_forward_bit_for_bit(arch, dtype, tiny_model_dir, monkeypatch, counted_steps):
    lm = load_model(str(tiny_model_dir(arch)), device="cpu", dtype=dtype)
    ids = [(i * 37 + 11) % (lm.config.vocab_size - 3) + 3 for i in range(40)]
    monkeypatch.setattr(decode_step, "ENABLED", False)  # KVSNAP_DECODE_STEP=0
    general_logits, general_kv = _steps(lm, ids, 25)
    assert not counted_steps
    monkeypatch.setattr(decode_step, "ENABLED", True)
    step_logits, step_kv = _steps(lm, ids, 25)
    assert len(counted_steps) == 15  # the 15 one-token forwards, not the 25-token chunk
    assert all(torch.equal(a, b) for a, b in zip(general_logits, step_logits))
    assert torch.equal(general_kv, step_kv)


@pytest.mark.parametrize("one_row", ["packed", "plain"])
def test_a_decode_step_over_packed_weights_is_the_general_forward_over_them(
    one_row, tiny_model_dir, monkeypatch, counted_steps
):
    monkeypatch.setattr(packing, "ONE_ROW", one_row)
    lm = load_model(str(tiny_model_dir("llama")), device="cpu")
    assert start_packing(lm)
    lm.model.packing.wait()
    ids = list(range(3, 40))
    monkeypatch.setattr(decode_step, "ENABLED", False)
    general = _steps(lm, ids, 20)
    monkeypatch.setattr(decode_step, "ENABLED", True)
    step = _steps(lm, ids, 20)
    assert len(counted_steps) == 17
    assert all(torch.equal(a, b) for a, b in zip(general[0], step[0])) and torch.equal(general[1], step[1])


def test_an_exact_forward_never_takes_the_decode_step(tiny_lm, counted_steps):
    # The exact forward computes a decode step as it computes a prefill row: that is its guarantee.
    lm = tiny_lm("llama")
    ids = list(range(3, 40))
    whole_kv, _ = prefill_kv(lm, ids, [(0, len(ids))], exact=True)
    one_at_a_time_kv, _ = prefill_kv(lm, ids, cuts(len(ids), [1]), exact=True)
    assert not counted_steps and torch.equal(whole_kv, one_at_a_time_kv)


def test_a_resumed_chat_decodes_as_the_one_kept_in_memory(tiny_lm, tmp_path, counted_steps):
    lm = tiny_lm("llama")
    ids = list(range(5, 45))
    kept = Session(lm, block_size=8)
    kept.prefill(ids)
    first = kept.generate(GREEDY)
    path = tmp_path / "turn.kv"
    kept.save(path)
    follow_up = [*kept.all_tokens, *range(50, 60)]
    resumed = Session(lm, block_size=8)
    assert resumed.restore(path, follow_up).hit_tokens > 0
    resumed.prefill(follow_up)
    kept.prefill(follow_up)
    assert counted_steps  # the decode ran through the step
    assert resumed.generate(GREEDY).token_ids == kept.generate(GREEDY).token_ids
    assert len(first.token_ids) == GREEDY.max_new_tokens
