"""Sliding-window families (Mistral, Qwen2 and Phi-3 with a window, Gemma 2, Gemma 3) on tiny models:
kvsnap's cache keeps every position of every layer and hands a sliding layer's attention only its
window, so a prompt several windows long gives, one forward or in chunks, cold or resumed from a
``.kv`` file or the block store, the logits and greedy tokens of transformers' own forward without
any cache. Families kvsnap cannot resume exactly are refused in one line that says why.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from tiny_models import CORPUS, SLIDING, UNSUPPORTED, build_tiny_model

from kvsnap.config import SamplingParams
from kvsnap.engine.results import TurnResult
from kvsnap.engine.runner import Generation
from kvsnap.engine.session import Session
from kvsnap.errors import UnsupportedModelError
from kvsnap.models import load_model, native_config
from kvsnap.store import BlockStore

BS = 8
GREEDY = SamplingParams(temperature=0, max_new_tokens=8, stop_loops=False)
ATOL = 1e-4
P_LEN = 67  # the stored prefix: over four windows of the longest (16), ending mid-block
Q_LEN = 45  # the new suffix: more than one 32-token chunk, several windows


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """``reference(arch)``: the tiny model as transformers loads it by itself (eager attention, no kvsnap)."""
    from transformers import AutoModelForCausalLM

    models: dict[str, torch.nn.Module] = {}

    def get(arch: str) -> torch.nn.Module:
        if arch not in models:
            folder = tiny_model_dir(arch)
            models[arch] = AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager").eval()
        return models[arch]

    return get


@pytest.fixture(scope="module")
def want(reference, tiny_lm):
    """``want(arch)``: ``expected`` for the test prompt, computed once per architecture."""
    done: dict[str, tuple[torch.Tensor, list[int]]] = {}

    def get(arch: str) -> tuple[torch.Tensor, list[int]]:
        if arch not in done:
            lm = tiny_lm(arch)
            done[arch] = expected(reference(arch), lm, prompt_of(lm))
        return done[arch]

    return get


def prompt_of(lm) -> list[int]:
    ids = list(lm.tokenizer(" ".join(CORPUS), add_special_tokens=False)["input_ids"])
    assert len(ids) >= P_LEN + Q_LEN
    return ids[: P_LEN + Q_LEN]


def expected(model, lm, prompt: list[int], steps: int = GREEDY.max_new_tokens) -> tuple[torch.Tensor, list[int]]:
    """transformers' last-position logits for ``prompt`` and its greedy continuation, every step one
    forward over the whole sequence without a cache."""
    ids = list(prompt)
    logits = None
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(steps):
            row = model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
            logits = row if logits is None else logits
            token = int(row.argmax())
            out.append(token)
            if token in lm.eos_token_ids:
                break
            ids.append(token)
    return logits, out


def run(session: Session, prompt: list[int], **kwargs) -> tuple[TurnResult, list[int]]:
    """``session.run`` greedily; its result and the generated token ids."""
    generated: list[Generation | None] = []
    result = session.run(prompt, GREEDY, on_generated=generated.append, **kwargs)
    return result, list(generated[0].token_ids)


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.allclose(a, b, atol=ATOL, rtol=0), f"max abs diff {float((a - b).abs().max()):.3g}"


def assert_holds_every_position(session: Session) -> None:
    for layer in session.cache.layers:
        assert layer.keys.shape[-2] == layer.values.shape[-2] == len(session.tokens)


@pytest.mark.parametrize("chunk_size", [1, 7, 32, 512])
@pytest.mark.parametrize("arch", list(SLIDING))
def test_cold_prefill_in_any_chunks_equals_transformers(arch, chunk_size, tiny_lm, want, forward_counter):
    lm = tiny_lm(arch)
    assert lm.backend == "transformers"
    prompt = prompt_of(lm)
    want_logits, want_tokens = want(arch)
    counter = forward_counter(lm)
    s = Session(lm, block_size=BS, chunk_size=chunk_size)
    s.prefill(prompt)
    assert counter.calls == math.ceil(len(prompt) / chunk_size) and counter.tokens == len(prompt)
    assert_holds_every_position(s)
    assert_close(s.last_logits, want_logits)
    assert list(s.generate(GREEDY).token_ids) == want_tokens


@pytest.mark.parametrize("chunk_size", [1, 7, 32])
@pytest.mark.parametrize("arch", list(SLIDING))
def test_resumed_from_a_snapshot_equals_transformers(arch, chunk_size, tiny_lm, want, forward_counter, tmp_path):
    lm = tiny_lm(arch)
    prompt = prompt_of(lm)
    want_logits, want_tokens = want(arch)
    first = Session(lm, block_size=BS)
    first.prefill(prompt[:P_LEN])
    first.save(tmp_path / "p.kv")

    counter = forward_counter(lm)
    s = Session(lm, block_size=BS, chunk_size=chunk_size, verify=True)  # verify: recompute a restored block
    result = s.run(prompt, SamplingParams(max_new_tokens=0), resume=tmp_path / "p.kv")
    assert result.restore_error is None and result.hit_tokens == P_LEN
    assert result.verify["passed"] and result.verify_max_abs_diff <= ATOL
    # The model saw the suffix only (and the check's recompute of the blocks it checked).
    assert counter.tokens == Q_LEN + result.verify["tokens"]
    checks = 3 * len(result.verify["blocks"])  # each checked block, and a token twice
    assert counter.calls == math.ceil(Q_LEN / chunk_size) + checks
    assert_holds_every_position(s)
    assert_close(s.last_logits, want_logits)
    assert list(s.generate(GREEDY).token_ids) == want_tokens


@pytest.mark.parametrize("arch", list(SLIDING))
def test_resumed_through_the_block_store_equals_transformers(arch, tiny_lm, want, forward_counter, tmp_path):
    lm = tiny_lm(arch)
    prompt = prompt_of(lm)
    _, want_tokens = want(arch)
    store = BlockStore(tmp_path / "store")
    Session(lm, block_size=BS, store=store).run(prompt[:P_LEN], SamplingParams(max_new_tokens=0))

    counter = forward_counter(lm)
    result, tokens = run(Session(lm, block_size=BS, store=store, chunk_size=7), prompt)
    hit = P_LEN // BS * BS  # the store keeps whole blocks
    assert result.restored_from == "store" and result.hit_tokens == hit
    assert counter.tokens == len(prompt) - hit + len(tokens) - 1
    assert tokens == want_tokens


@pytest.mark.parametrize("arch", [a for a in SLIDING if a != "gemma2"])  # Gemma 2 runs eager everywhere
def test_transformers_sdpa_over_the_cache_equals_transformers(arch, tiny_lm, want, tiny_model_dir, tmp_path):
    """On a GPU the attention is transformers' own sdpa, not kvsnap's: the same windows, through it."""
    from transformers import AutoModelForCausalLM

    lm = tiny_lm(arch)
    sdpa = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir(arch)), attn_implementation="sdpa").eval()
    lm = dataclasses.replace(lm, model=sdpa)
    prompt = prompt_of(lm)
    want_logits, want_tokens = want(arch)
    first = Session(lm, block_size=BS, chunk_size=7)
    first.prefill(prompt[:P_LEN])
    first.save(tmp_path / "p.kv")
    s = Session(lm, block_size=BS, chunk_size=7)
    s.restore(tmp_path / "p.kv", prompt)
    s.prefill(prompt)
    assert_close(s.last_logits, want_logits)
    assert list(s.generate(GREEDY).token_ids) == want_tokens


@pytest.mark.parametrize("arch", list(SLIDING))
def test_the_window_changes_the_answer(arch, tiny_lm, reference):
    """The comparisons above would catch a window left out: without it, the logits move far."""
    lm = tiny_lm(arch)
    model = reference(arch)
    prompt = prompt_of(lm)
    with_window, _ = expected(model, lm, prompt, steps=1)
    window = model.config.sliding_window
    model.config.sliding_window = 10 * len(prompt)
    try:
        without, _ = expected(model, lm, prompt, steps=1)
    finally:
        model.config.sliding_window = window
    assert float((with_window - without).abs().max()) > 100 * ATOL


@pytest.mark.parametrize("arch", list(SLIDING))
def test_sliding_layers_are_sliding_to_transformers(arch, tiny_lm):
    lm = tiny_lm(arch)
    s = Session(lm, block_size=BS)
    s.prefill(prompt_of(lm)[:40])
    sliding = [getattr(layer, "window", None) is not None for layer in s.cache.layers]
    assert s.cache.is_sliding == sliding and any(sliding)
    for layer in s.cache.layers:
        if layer.window is not None:  # as transformers' own sliding layer: the last window - 1, plus the query
            assert layer.get_mask_sizes(1) == (layer.window, 40 - layer.window + 1)
        else:
            assert layer.get_mask_sizes(1) == (41, 0)
    # The native forward takes none of them.
    assert native_config.unsupported_reason(lm.config, lm.device) is not None


def test_a_sliding_layer_keeps_everything_and_returns_its_window():
    from transformers import MistralConfig

    from kvsnap.engine.cache import KVCache

    config = MistralConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, hidden_size=8)
    config.sliding_window = 4
    layer = KVCache(config).layers[0]
    kv = torch.arange(10.0).reshape(1, 1, 10, 1)
    keys, _ = layer.update(kv[:, :, :3], kv[:, :, :3])
    assert keys.flatten().tolist() == [0, 1, 2] and layer.get_mask_sizes(5) == (8, 0)
    keys, _ = layer.update(kv[:, :, 3:8], kv[:, :, 3:8])
    assert keys.flatten().tolist() == [0, 1, 2, 3, 4, 5, 6, 7]  # position 3 still sees 0
    assert layer.get_mask_sizes(2) == (5, 5)
    keys, _ = layer.update(kv[:, :, 8:], kv[:, :, 8:])
    assert keys.flatten().tolist() == [5, 6, 7, 8, 9]  # position 8 sees 5, 6, 7 and itself
    assert layer.keys.flatten().tolist() == list(range(10))  # held: every position


REASONS = {
    "gemma2-no-window": "sets no sliding_window",
    "gemma3-bidirectional": "bidirectional attention",
    "cohere2": "resumes sliding windows exactly only for",
}


@pytest.mark.parametrize("kind", list(UNSUPPORTED))
def test_what_cannot_resume_exactly_is_refused_in_one_line(kind, tmp_path):
    folder = build_tiny_model(tmp_path / kind, kind)
    with pytest.raises(UnsupportedModelError) as info:
        load_model(str(folder), device="cpu")
    message = str(info.value)
    assert REASONS[kind] in message and "\n" not in message


@pytest.mark.parametrize(
    ("config_class", "settings", "reason"),
    [
        ("Gemma3Config", {}, "vision-language model"),
        ("Llama4TextConfig", {"num_hidden_layers": 2}, "chunked attention"),
        ("MixtralConfig", {"num_hidden_layers": 2, "sliding_window": 16}, "exactly only for"),
    ],
)
def test_other_configs_are_refused_naming_the_reason(config_class, settings, reason):
    import transformers

    from kvsnap.models import architecture

    with pytest.raises(UnsupportedModelError, match=reason):
        architecture.check_supported(getattr(transformers, config_class)(**settings))
