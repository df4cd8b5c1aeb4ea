"""The batch-invariant forward (``exact``, kvsnap/models/exact.py) on the tiny models, float32 and bfloat16.

A token's K and V must not depend on how the prompt was cut into forwards: one forward, chunks of 32,
one token at a time, chunks that divide nothing. Then a resumed run is a cold run bit for bit (greedy
tokens, logits and KV) in bfloat16 too, loading a stored prefix or recomputing it gives the same
answer, and a resumed session continues exactly as the one kept in memory. bfloat16 on a CPU without
bfloat16 instructions is emulated: slower, as deterministic.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from exact_diagnosis import cuts, prefill_kv, report, sources
from typer.testing import CliRunner

from cli.main import app
from kvsnap.config import SamplingParams, SessionConfig
from kvsnap.engine.session import Session
from kvsnap.errors import ConfigError
from kvsnap.models import exact, load_model

GREEDY = SamplingParams(temperature=0, max_new_tokens=10)
DTYPES = ("float32", "bfloat16")
TOKENS = 150  # past two key blocks and many query tiles and row tiles
CUTS = {
    "32": [32],
    "one token at a time": [1],
    "7 and 13": [7, 13],
    "17, 1, 64": [17, 1, 64],
    "149 then 1": [TOKENS - 1],
}
SYSTEM = "You are a concise assistant. Answer in one short sentence, plainly, and say so when you do not know."
QUESTIONS = (
    "What is the capital of France?",
    "And of Italy?",
    "How are you today?",
    "Once upon a time there was a small cache.",
    "hello world 0123456789",
)


def _ids(lm, count: int = TOKENS) -> list[int]:
    vocab = lm.config.vocab_size
    return [(i * 37 + 11) % (vocab - 3) + 3 for i in range(count)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biases on q/k/v
def test_kv_is_bitwise_the_same_however_the_prompt_is_cut(arch, dtype, tiny_lm):
    lm = tiny_lm(arch, dtype)
    ids = _ids(lm)
    whole_kv, whole_logits = prefill_kv(lm, ids, [(0, TOKENS)], exact=True)
    for name, sizes in CUTS.items():
        kv, logits = prefill_kv(lm, ids, cuts(TOKENS, sizes), exact=True)
        if not (torch.equal(kv, whole_kv) and torch.equal(logits, whole_logits)):
            found = sources(lm, ids, [(0, TOKENS)], cuts(TOKENS, sizes), exact=True)
            pytest.fail(f"{arch} {dtype}, chunks of {name}: the KV depends on the cut\n{report(found, TOKENS)}")


def test_the_diagnosis_names_the_operations_that_depend_on_the_cut(tiny_lm):
    """The plain forward's bfloat16 attention (torch's SDPA, blocked by the query count) is one; the exact
    forward has none."""
    lm = tiny_lm("llama", "bfloat16")
    ids, cut = _ids(lm, 100), cuts(100, [7, 13])
    plain = sources(lm, ids, [(0, 100)], cut, exact=False)
    assert plain and all(0 < changed <= 100 for _, _, changed in plain)
    assert "attention" in report(plain, 100) or "proj" in report(plain, 100)
    assert sources(lm, ids, [(0, 100)], cut, exact=True) == []
    assert report([], 100).startswith("no operation depends on the cut")


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_exact_forward_is_the_same_model(dtype, tiny_lm):
    """Other kernels, the same function: logits and KV within the dtype's rounding of the plain forward's."""
    lm = tiny_lm("llama", dtype)
    ids = _ids(lm, 90)
    chunked = cuts(90, [40])
    (kv, logits), (plain_kv, plain_logits) = prefill_kv(lm, ids, chunked, True), prefill_kv(lm, ids, chunked, False)
    tol = 1e-5 if dtype == "float32" else 3e-2
    torch.testing.assert_close(logits, plain_logits, rtol=tol, atol=tol * float(plain_logits.abs().max()))
    torch.testing.assert_close(kv.float(), plain_kv.float(), rtol=tol, atol=tol * float(plain_kv.abs().max()))


@pytest.mark.parametrize("past", [0, 5, 64, 130])
@pytest.mark.parametrize("count", [1, 3, 8, 21])
def test_exact_attention_is_causal_attention(past, count):
    """Against torch's SDPA (float64): grouped heads, a past, tiles and key blocks cut mid-way."""
    gen = torch.Generator().manual_seed(past * 100 + count)
    heads, kv_heads, dim = 6, 2, 16
    q = torch.randn(1, heads, count, dim, generator=gen)
    k = torch.randn(1, kv_heads, past + count, dim, generator=gen)
    v = torch.randn(1, kv_heads, past + count, dim, generator=gen)
    plan = exact.Plan.of(past, count, heads // kv_heads, q.device)
    got = exact.attention(q, k, v, dim**-0.5, plan)
    seen = torch.arange(past + count)[None, :] <= torch.arange(past, past + count)[:, None]
    want = F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=seen, scale=dim**-0.5, enable_gqa=True
    )
    torch.testing.assert_close(got, want.transpose(1, 2).reshape(1, count, -1).float(), rtol=1e-5, atol=1e-5)


def test_exact_attention_batched_any_way_alike(monkeypatch):
    """Along the tiles, along the blocks, tiles in groups of one: bitwise the same rows."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, n, 16, generator=gen) for h, n in ((6, 40), (2, 300), (2, 300)))
    plan = exact.Plan.of(260, 40, 3, q.device)
    along_tiles, along_blocks = (exact.attention(q, k, v, 0.25, plan, by_tile=way) for way in (True, False))
    monkeypatch.setattr(exact, "SCORES_BYTES", 1)
    one_tile_at_a_time = exact.attention(q, k, v, 0.25, plan)
    assert torch.equal(along_tiles, along_blocks) and torch.equal(along_tiles, one_tile_at_a_time)


def test_row_tiles_give_every_row_alike():
    """Rows of a linear product in any count and at any place of a tile: bitwise the same results."""
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 40, generator=gen), torch.randn(48, generator=gen)
    x = torch.randn(70, 40, generator=gen)

    def product(rows):
        return F.linear(rows, weight, bias)

    whole = exact.in_row_tiles(x, product)
    torch.testing.assert_close(whole, product(x), rtol=1e-5, atol=1e-5)
    for start, end in [(0, 1), (3, 4), (5, 21), (16, 32), (30, 70), (69, 70)]:
        assert torch.equal(exact.in_row_tiles(x[start:end], product), whole[start:end]), (start, end)
    assert torch.equal(exact.in_row_tiles(x[None, 2:9], product)[0], whole[2:9])  # batch dims kept


def _prime(lm, tmp_path) -> tuple[Session, object]:
    primer = Session(lm, block_size=16, exact=True)
    primer.prefill(primer.render_chat([{"role": "system", "content": SYSTEM}], add_generation_prompt=False))
    path = tmp_path / "system.kv"
    primer.save(path)
    return primer, path


@pytest.mark.parametrize("chunk_size", [512, 8])
def test_bfloat16_resumed_equals_cold(tiny_lm, tmp_path, chunk_size):
    """A system prompt primed once, then five questions: resumed runs answer exactly as cold ones, with
    bitwise the same logits and KV."""
    lm = tiny_lm("llama", "bfloat16")
    primer, path = _prime(lm, tmp_path)
    for question in QUESTIONS:
        ids = primer.render_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
        cold = Session(lm, block_size=16, chunk_size=chunk_size, exact=True)
        cold_result = cold.run(ids, GREEDY)
        resumed = Session(lm, block_size=16, chunk_size=chunk_size, reuse="load", exact=True)
        result = resumed.run(ids, GREEDY, resume=path)
        assert result.hit_tokens == len(primer.tokens) and result.prefill_tokens == len(ids) - len(primer.tokens)
        assert result.text == cold_result.text, question
        assert resumed.all_tokens == cold.all_tokens
        assert torch.equal(resumed.last_logits, cold.last_logits)
        assert torch.equal(resumed.cache.span(0, resumed.num_tokens), cold.cache.span(0, cold.num_tokens))


def test_bfloat16_load_and_recompute_answer_alike(tiny_lm, tmp_path):
    lm = tiny_lm("llama", "bfloat16")
    primer, path = _prime(lm, tmp_path)
    ids = primer.render_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}])
    loaded = Session(lm, block_size=16, chunk_size=8, reuse="load", exact=True)
    recomputed = Session(lm, block_size=16, chunk_size=8, reuse="recompute", exact=True)
    a, b = loaded.run(ids, GREEDY, resume=path), recomputed.run(ids, GREEDY, resume=path)
    assert (a.reuse_decision, b.reuse_decision) == ("load", "recompute") and a.hit_tokens > 0 == b.hit_tokens
    assert a.text == b.text and torch.equal(loaded.last_logits, recomputed.last_logits)
    assert torch.equal(loaded.cache.span(0, loaded.num_tokens), recomputed.cache.span(0, recomputed.num_tokens))


@pytest.mark.parametrize("exact_forward", [False, True])
def test_bfloat16_resume_continues_as_the_session_kept_in_memory(tiny_lm, tmp_path, exact_forward):
    lm = tiny_lm("llama", "bfloat16")
    kept = Session(lm, block_size=16, chunk_size=8, exact=exact_forward)
    kept.chat(QUESTIONS[0], GREEDY, system=SYSTEM)
    kept.save(tmp_path / "turn1.kv")
    resumed = Session(lm, block_size=16, chunk_size=8, reuse="load", exact=exact_forward)
    resumed.restore(tmp_path / "turn1.kv")
    assert torch.equal(resumed.cache.span(0, resumed.num_tokens), kept.cache.span(0, kept.num_tokens))
    a, b = kept.chat(QUESTIONS[1], GREEDY), resumed.chat(QUESTIONS[1], GREEDY)
    assert b.hit_tokens == len(kept.tokens) - b.prefill_tokens - b.new_tokens + 1 or b.hit_tokens > 0
    assert a.text == b.text and kept.all_tokens == resumed.all_tokens
    assert torch.equal(kept.last_logits, resumed.last_logits)
    assert torch.equal(kept.cache.span(0, kept.num_tokens), resumed.cache.span(0, resumed.num_tokens))


def test_cli_exact_flag_load_and_recompute_alike_in_bfloat16(tiny_model_dir, tmp_path):
    runner = CliRunner()
    base = ["--model", str(tiny_model_dir("llama")), "--device", "cpu", "--dtype", "bfloat16", "--block-size", "16"]
    base += ["--exact", "--temperature", "0"]
    # Primed in chunks of 5, answered in chunks of 8: the loaded prefix and the recomputed one are cut apart.
    prime = ["--prompt", SYSTEM, "--max-new-tokens", "0", "--chunk-size", "5", "--save", str(tmp_path / "p.kv")]
    primed = runner.invoke(app, ["run", *base, *prime])
    assert primed.exit_code == 0, primed.output
    rows, saved = {}, {}
    for reuse in ("load", "recompute"):
        saved[reuse] = tmp_path / f"{reuse}.kv"
        args = ["run", *base, "--prompt", f"{SYSTEM} {QUESTIONS[0]}", "--max-new-tokens", "10", "--chunk-size", "8"]
        args += ["--resume", str(tmp_path / "p.kv")]
        out = runner.invoke(app, [*args, "--reuse", reuse, "--save", str(saved[reuse]), "--json"])
        assert out.exit_code == 0, out.output
        rows[reuse] = json.loads(out.stdout)
    assert rows["load"]["reuse_decision"] == "load" and rows["load"]["hit_tokens"] > 0
    assert rows["recompute"]["reuse_decision"] == "recompute" and rows["recompute"]["hit_tokens"] == 0
    assert rows["load"]["text"] == rows["recompute"]["text"]
    lm = load_model(str(tiny_model_dir("llama")), device="cpu", dtype="bfloat16")
    restored = {}
    for reuse, path in saved.items():
        s = Session(lm, block_size=16)
        s.restore(path)
        restored[reuse] = (s.tokens, s.cache.span(0, s.num_tokens))
    assert restored["load"][0] == restored["recompute"][0]
    assert torch.equal(restored["load"][1], restored["recompute"][1])


def test_exact_is_a_checked_setting_of_the_native_forward(tiny_lm, tiny_model_dir, monkeypatch):
    assert SessionConfig().exact is False
    with pytest.raises(ConfigError, match="exact"):
        SessionConfig(exact="yes").check()
    monkeypatch.setenv("KVSNAP_NATIVE", "0")
    theirs = load_model(str(tiny_model_dir("llama")), device="cpu")
    with pytest.raises(ConfigError, match="native forward"):
        Session(theirs, exact=True)
    assert Session(theirs).runner.exact is False
