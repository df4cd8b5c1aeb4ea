"""Session and runner on tiny random-weight models: resume == cold, the suffix-only prefill, the ledger,
incremental saves, refusing damaged or foreign snapshots without side effects, chat, sampling, interrupts.

"Cold" is always a fresh session that prefills the whole prompt; "resumed" restores a snapshot of a
prefix first. Greedy tokens must be identical and the last-position logits equal within fp32 noise.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from tiny_models import ARCHS, flip_byte, perturbed_copy, tensor_span

from kvsnap.engine.sampling import SamplingParams, TextStream, sample
from kvsnap.engine.session import Session
from kvsnap.errors import ConfigError, ForeignSnapshotError, SnapshotError
from kvsnap.format import Snapshot
from kvsnap.format import codec as codecs
from kvsnap.models import load_model

BS = 8  # small block size: prompts of a few dozen tokens span several blocks
GREEDY = SamplingParams(temperature=0, max_new_tokens=8)
ATOL = 1e-4
TEXT = (
    "Once upon a time there was a small cache that kept every key and value it had ever seen. "
    "The quick brown fox jumps over the lazy dog."
)
OTHER = "0123456789 hello world how are you today? What is the capital of France?"
Q_LEN = 13
# Where the snapshot's prefix P ends: on a block boundary, mid-block, or mid-block inside a longer
# snapshot that diverges from the prompt right after P (a token-granular hit into a full stored block).
SPLITS = {"boundary": (3 * BS, False), "mid": (2 * BS + 5, False), "diverge": (2 * BS + 5, True)}


def token_ids(lm, text: str = TEXT) -> list[int]:
    return list(lm.tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_parts(lm, p_len: int) -> tuple[list[int], list[int]]:
    ids = token_ids(lm)
    assert len(ids) >= p_len + Q_LEN
    return ids[:p_len], ids[p_len : p_len + Q_LEN]


def divergent_tail(lm, q: list[int]) -> list[int]:
    other = token_ids(lm, OTHER)[:11]
    assert other[0] != q[0]
    return other


def cold(lm, prompt: list[int], params: SamplingParams = GREEDY) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Last-position logits after a fresh prefill of ``prompt``, and the tokens generated after it."""
    s = Session(lm, block_size=BS)
    s.prefill(prompt)
    logits = s.last_logits.clone()
    return logits, s.generate(params).token_ids


def save_prefix(lm, tokens: list[int], path, **session_kwargs) -> Session:
    s = Session(lm, block_size=BS, **session_kwargs)
    s.prefill(tokens)
    s.save(path)
    return s


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.allclose(a, b, atol=ATOL, rtol=0), f"max abs diff {float((a - b).abs().max()):.3g}"


def cache_tensors(session: Session) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys.clone(), layer.values.clone()) for layer in session.cache.layers]


def assert_invariants(session: Session) -> None:
    assert session.cache.length == len(session.tokens)
    for layer in session.cache.layers:
        assert layer.keys.shape[-2] == layer.values.shape[-2] == len(session.tokens)


# ---------------------------------------------------------------------------------------------
# Resumed == cold


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("chunk_size", [1, 7, 512])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_resumed_equals_cold(arch, chunk_size, split, tiny_lm, forward_counter, tmp_path):
    lm = tiny_lm(arch)
    p_len, diverge = SPLITS[split]
    p, q = prompt_parts(lm, p_len)
    cold_logits, cold_tokens = cold(lm, p + q)

    path = tmp_path / "p.kv"
    save_prefix(lm, p + divergent_tail(lm, q) if diverge else p, path)

    s = Session(lm, block_size=BS, chunk_size=chunk_size)
    stats = s.restore(path, p + q)
    assert stats.hit_tokens == len(p)
    assert s.tokens == p
    assert_invariants(s)
    counter = forward_counter(lm)
    seen0 = s.runner.tokens_seen
    plan, seen = s.prefill(p + q)
    # The model's forward saw exactly the suffix, in ceil(len(Q) / chunk_size) calls.
    assert counter.tokens == seen == len(q) == s.runner.tokens_seen - seen0
    assert counter.calls == math.ceil(len(q) / chunk_size) == len(plan.chunks)
    assert plan.hit_tokens == len(p) and plan.logits_source == "prefill"
    assert_invariants(s)
    assert_close(s.last_logits, cold_logits)
    assert s.generate(GREEDY).token_ids == cold_tokens


@pytest.mark.parametrize("p_len", [3 * BS, 2 * BS + 5])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_whole_prompt_hit_uses_stored_logits(arch, p_len, tiny_lm, forward_counter, tmp_path):
    """Resuming with exactly the snapshot's tokens: logits come from the file, the model runs zero tokens."""
    lm = tiny_lm(arch)
    p, _ = prompt_parts(lm, p_len)
    cold_logits, cold_tokens = cold(lm, p)
    path = tmp_path / "p.kv"
    writer = save_prefix(lm, p, path)

    s = Session(lm, block_size=BS)
    assert s.restore(path, p).hit_tokens == len(p)
    counter = forward_counter(lm)
    plan, seen = s.prefill(p)
    assert plan.logits_source == "snapshot"
    assert seen == counter.tokens == counter.calls == 0
    assert plan.chunks == ()
    assert torch.equal(s.last_logits, writer.last_logits)  # stored float32 logits, bit for bit
    assert_close(s.last_logits, cold_logits)
    assert s.generate(GREEDY).token_ids == cold_tokens


@pytest.mark.parametrize("p_len", [3 * BS, 2 * BS + 5])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_prompt_shorter_than_snapshot_backs_off_one_token(arch, p_len, tiny_lm, forward_counter, tmp_path):
    lm = tiny_lm(arch)
    p, q = prompt_parts(lm, p_len)
    cold_logits, cold_tokens = cold(lm, p)
    path = tmp_path / "pq.kv"
    save_prefix(lm, p + q, path)

    s = Session(lm, block_size=BS)
    assert s.restore(path, p).hit_tokens == len(p)
    assert s.last_logits is None  # the stored logits belong to P+Q, not to P
    counter = forward_counter(lm)
    plan, seen = s.prefill(p)
    assert plan.logits_source == "backoff"
    assert seen == counter.tokens == counter.calls == 1
    assert_invariants(s)
    assert_close(s.last_logits, cold_logits)
    assert s.generate(GREEDY).token_ids == cold_tokens


def test_comparisons_are_sensitive_to_positions_and_prefix(llama, tmp_path):
    """Negative control: a wrong RoPE position or one wrong prefix token moves the logits far past ATOL."""
    lm = llama
    p, q = prompt_parts(lm, 2 * BS + 5)
    cold_logits, _ = cold(lm, p + q)

    path = tmp_path / "p.kv"
    save_prefix(lm, p, path)
    s = Session(lm, block_size=BS)
    s.restore(path, p + q)
    shifted = torch.arange(len(p) + 1, len(p) + 1 + len(q)).unsqueeze(0)  # off by one
    with torch.inference_mode():
        out = lm.model(input_ids=torch.tensor([q]), position_ids=shifted, **{lm.cache_kwarg: s.cache})
    assert (out.logits[0, -1].float() - cold_logits).abs().max() > 100 * ATOL

    wrong = list(p)
    wrong[3] = (wrong[3] + 1) % len(lm.tokenizer)
    other_logits, _ = cold(lm, wrong + q)
    assert (other_logits - cold_logits).abs().max() > 100 * ATOL


def test_unrelated_snapshot_hits_nothing_and_still_equals_cold(llama, forward_counter, tmp_path):
    lm = llama
    p, q = prompt_parts(lm, 2 * BS)
    other = token_ids(lm, OTHER)[:20]
    assert other[0] != p[0]
    path = tmp_path / "other.kv"
    save_prefix(lm, other, path)
    cold_logits, cold_tokens = cold(lm, p + q)

    s = Session(lm, block_size=BS)
    assert s.restore(path, p + q).hit_tokens == 0
    assert_invariants(s)
    counter = forward_counter(lm)
    s.prefill(p + q)
    assert counter.tokens == len(p + q)
    assert_close(s.last_logits, cold_logits)
    assert s.generate(GREEDY).token_ids == cold_tokens


def test_snapshot_with_another_block_size_is_usable(llama, tmp_path):
    """The chain root uses the file's block size, so a session with another block size still resumes."""
    lm = llama
    p, q = prompt_parts(lm, 2 * BS + 5)
    cold_logits, _ = cold(lm, p + q)
    path = tmp_path / "bs4.kv"
    s4 = Session(lm, block_size=4)
    s4.prefill(p)
    s4.save(path)

    s = Session(lm, block_size=BS)
    assert s.restore(path, p + q).hit_tokens == len(p)
    s.prefill(p + q)
    assert_close(s.last_logits, cold_logits)
    stats = s.save(tmp_path / "bs8.kv")
    assert stats.blocks_reused == 0  # the file's blocks have another size: nothing to reuse as is


# ---------------------------------------------------------------------------------------------
# Session.run: the ledger


@pytest.mark.parametrize("chunk_size", [1, 7, 512])
def test_run_with_resume_reports_the_ledger(chunk_size, llama, forward_counter, tmp_path):
    lm = llama
    p, q = prompt_parts(lm, 2 * BS + 5)
    _, cold_tokens = cold(lm, p + q)
    cold_text = lm.tokenizer.decode(list(cold_tokens), skip_special_tokens=True)
    path = tmp_path / "p.kv"
    save_prefix(lm, p, path)

    s = Session(lm, block_size=BS, chunk_size=chunk_size)
    counter = forward_counter(lm)
    r = s.run(p + q, GREEDY, resume=path)
    assert r.prompt_tokens == len(p + q)
    assert r.hit_tokens == len(p)
    assert r.prefill_tokens == len(q)
    assert r.chunks == math.ceil(len(q) / chunk_size)
    assert r.reuse_ratio == round(len(p) / len(p + q), 6)
    assert r.logits_source == "prefill"
    assert r.restored_from == str(path)
    assert r.new_tokens == GREEDY.max_new_tokens and r.stop_reason == "length"
    assert r.text == cold_text
    assert r.ttft_s is not None and 0 <= r.ttft_s <= r.total_s
    # Prefill saw Q; decoding ran every sampled token but the last (it stays pending).
    assert counter.tokens == len(q) + r.new_tokens - 1
    assert r.to_dict()["hit_tokens"] == len(p)

    # Without decoding, what the model's forward saw is exactly the reported prefill_tokens.
    counter.reset()
    primed = Session(lm, block_size=BS, chunk_size=chunk_size).run(p + q, SamplingParams(max_new_tokens=0), resume=path)
    assert counter.tokens == primed.prefill_tokens == len(q)


def test_run_whole_prompt_ledgers(llama, tmp_path):
    lm = llama
    p, q = prompt_parts(lm, 3 * BS)
    save_prefix(lm, p, tmp_path / "p.kv")
    save_prefix(lm, p + q, tmp_path / "pq.kv")
    r = Session(lm, block_size=BS).run(p, GREEDY, resume=tmp_path / "p.kv")
    assert (r.hit_tokens, r.prefill_tokens, r.chunks, r.logits_source) == (len(p), 0, 0, "snapshot")
    assert r.reuse_ratio == 1.0
    r = Session(lm, block_size=BS).run(p, GREEDY, resume=tmp_path / "pq.kv")
    # Backing off recomputes the last prompt token: it is no longer counted as a hit.
    assert (r.hit_tokens, r.prefill_tokens, r.chunks, r.logits_source) == (len(p) - 1, 1, 1, "backoff")


def test_run_reuses_its_own_tokens_after_generating(llama, forward_counter):
    """A second prompt in the same session reuses the first prompt's KV and drops the generated tail."""
    lm = llama
    p, q = prompt_parts(lm, 2 * BS + 5)
    cold_logits, cold_tokens = cold(lm, p + q)
    s = Session(lm, block_size=BS, chunk_size=4)
    s.run(p, GREEDY)
    assert s.num_tokens == len(p) + GREEDY.max_new_tokens
    counter = forward_counter(lm)
    r = s.run(p + q, GREEDY)
    assert r.hit_tokens == len(p) and r.prefill_tokens == len(q) and r.chunks == 4
    assert counter.tokens == len(q) + r.new_tokens - 1
    # Compare the logits the second prompt produced with a cold prefill of it.
    s2 = Session(lm, block_size=BS)
    s2.run(p, GREEDY)
    s2.prefill(p + q)
    assert_close(s2.last_logits, cold_logits)
    assert_invariants(s2)
    assert tuple(s.all_tokens[len(p + q) :]) == cold_tokens


def test_run_with_zero_new_tokens_only_primes(llama, tmp_path):
    lm = llama
    p, _ = prompt_parts(lm, 2 * BS + 5)
    s = Session(lm, block_size=BS)
    r = s.run(p, SamplingParams(max_new_tokens=0))
    assert (r.text, r.new_tokens, r.stop_reason, r.ttft_s) == ("", 0, "none", None)
    stats = s.save(tmp_path / "primed.kv")
    assert stats.tokens == len(p) and stats.flushed_tokens == 0
    with Snapshot(tmp_path / "primed.kv") as snap:
        assert snap.tokens == p


# ---------------------------------------------------------------------------------------------
# Saving: incremental, bit-exact


def assert_restores_bit_exact(lm, path, live: Session) -> None:
    """A fresh session restoring ``path`` holds bitwise the live session's KV for the file's tokens."""
    s = Session(lm, block_size=BS)
    s.restore(path)
    n = len(s.tokens)
    assert s.tokens == live.tokens[:n]
    assert_invariants(s)
    for restored, original in zip(s.cache.layers, live.cache.layers):
        assert torch.equal(restored.keys, original.keys[..., :n, :])
        assert torch.equal(restored.values, original.values[..., :n, :])
    assert (s.cache.block_raw(0, n) == live.cache.block_raw(0, n)).all()


@pytest.mark.parametrize("codec", codecs.CODECS)
def test_save_is_incremental_and_restores_bit_exact(codec, llama, tmp_path):
    lm = llama
    ids = token_ids(lm)
    s = Session(lm, block_size=BS, codec=codec)
    s.prefill(ids[:20])
    first = s.save(tmp_path / "1.kv")
    assert (first.tokens, first.blocks, first.blocks_encoded, first.blocks_reused) == (20, 3, 3, 0)
    assert first.kv_bytes == 20 * lm.layout.bytes_per_token
    assert_restores_bit_exact(lm, tmp_path / "1.kv", s)

    gen = s.generate(GREEDY)
    assert len(s.pending) == 1
    second = s.save(tmp_path / "2.kv")
    assert second.flushed_tokens == 1 and not s.pending
    assert second.tokens == 20 + len(gen.token_ids) == len(s.tokens)
    assert second.blocks == math.ceil(second.tokens / BS)
    assert second.blocks_reused == 20 // BS  # the full blocks of the first save
    assert second.blocks_encoded == second.blocks - second.blocks_reused
    with Snapshot(tmp_path / "1.kv") as a, Snapshot(tmp_path / "2.kv") as b:
        for i in range(20 // BS):
            assert a.read_stored(i) == b.read_stored(i)
        assert b.tokens == s.tokens
        assert b.meta.codec == codec
    # Both files load back bitwise equal to the live cache (the first one to its prefix).
    assert_restores_bit_exact(lm, tmp_path / "1.kv", s)
    assert_restores_bit_exact(lm, tmp_path / "2.kv", s)

    # Nothing new, the partial tail included: `/save` right after an autosave used to report "1 new block".
    third = s.save(tmp_path / "3.kv")
    assert (third.blocks_reused, third.blocks_encoded) == (third.blocks, 0)
    assert_restores_bit_exact(lm, tmp_path / "3.kv", s)


def test_restored_blocks_are_not_encoded_again(llama, tmp_path):
    lm = llama
    ids = token_ids(lm)
    save_prefix(lm, ids[:30], tmp_path / "a.kv")
    s = Session(lm, block_size=BS)
    s.restore(tmp_path / "a.kv", ids[:45])
    s.prefill(ids[:45])
    stats = s.save(tmp_path / "b.kv")
    assert stats.blocks_reused == 30 // BS
    assert stats.blocks_encoded == stats.blocks - 30 // BS
    assert_restores_bit_exact(lm, tmp_path / "b.kv", s)


def test_truncation_drops_encodings_past_the_cut(llama, tmp_path):
    lm = llama
    ids = token_ids(lm)
    other = token_ids(lm, OTHER)
    s = Session(lm, block_size=BS)
    s.prefill(ids[:40])
    s.save(tmp_path / "a.kv")
    s.prefill(ids[:10] + other[:20])  # diverges inside block 1
    stats = s.save(tmp_path / "b.kv")
    assert stats.blocks_reused == 1
    assert_restores_bit_exact(lm, tmp_path / "b.kv", s)


# ---------------------------------------------------------------------------------------------
# Refusing damaged or foreign snapshots without touching the live session


def session_state(s: Session):
    return (
        list(s.tokens),
        list(s.pending),
        None if s.last_logits is None else s.last_logits.clone(),
        None if s.messages is None else [dict(m) for m in s.messages],
        cache_tensors(s),
        sorted(s.encoded.by_hash),
    )


def assert_same_state(before, after) -> None:
    tokens, pending, logits, messages, tensors, encoded = before
    assert after[0] == tokens and after[1] == pending and after[3] == messages and after[5] == encoded
    assert (logits is None) == (after[2] is None)
    if logits is not None:
        assert torch.equal(logits, after[2])
    assert len(tensors) == len(after[4])
    for (k, v), (k2, v2) in zip(tensors, after[4]):
        assert torch.equal(k, k2) and torch.equal(v, v2)


def live_session(lm, tmp_path) -> Session:
    """A session with some history: a prompt, generated tokens (one pending), a save."""
    s = Session(lm, block_size=BS)
    s.prefill(token_ids(lm, OTHER)[:19])
    s.generate(SamplingParams(temperature=0, max_new_tokens=3))
    s.save(tmp_path / "live.kv")
    s.generate(SamplingParams(temperature=0, max_new_tokens=2))
    assert s.pending
    return s


def damage(kind: str, path):
    data = path.read_bytes()
    if kind == "block":
        start, end = tensor_span(path, "block.000001")
        flip_byte(path, (start + end) // 2)
    elif kind == "logits":
        start, _ = tensor_span(path, "last_logits")
        flip_byte(path, start + 5)
    elif kind == "tokens":
        start, _ = tensor_span(path, "tokens")
        flip_byte(path, start)
    elif kind == "header":
        flip_byte(path, 40)
    elif kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "garbage":
        path.write_bytes(b"\x00" * 64)
    elif kind == "missing":
        path.unlink()
    return path


@pytest.mark.parametrize("kind", ["block", "logits", "tokens", "header", "truncated", "garbage", "missing"])
def test_damaged_snapshot_is_refused_and_leaves_the_session_alone(kind, llama, tmp_path):
    lm = llama
    p, q = prompt_parts(lm, 3 * BS)
    path = tmp_path / "p.kv"
    save_prefix(lm, p, path)
    damage(kind, path)

    s = live_session(lm, tmp_path)
    before = session_state(s)
    with pytest.raises(SnapshotError) as info:
        s.restore(path, p + q) if kind != "logits" else s.restore(path)
    assert "\n" not in str(info.value)
    assert_same_state(before, session_state(s))
    # The session still works where it was.
    expect = cold(lm, s.all_tokens)[0]
    s.prefill(s.all_tokens)
    assert_close(s.last_logits, expect)


def test_damaged_snapshot_is_refused_by_run_too(llama, tmp_path):
    lm = llama
    p, q = prompt_parts(lm, 3 * BS)
    path = tmp_path / "p.kv"
    save_prefix(lm, p, path)
    damage("block", path)
    s = live_session(lm, tmp_path)
    before = session_state(s)
    with pytest.raises(SnapshotError):
        s.run(p + q, GREEDY, resume=path)
    assert_same_state(before, session_state(s))


def test_only_the_matched_blocks_are_read(llama, forward_counter, tmp_path):
    """Reading is lazy: damage in a block past the matched prefix does not matter."""
    lm = llama
    ids = token_ids(lm)
    path = tmp_path / "long.kv"
    save_prefix(lm, ids[:40], path)
    damage("block", path)  # block 1: tokens 8..15
    prompt = ids[:6] + token_ids(lm, OTHER)[:10]
    s = Session(lm, block_size=BS)
    stats = s.restore(path, prompt)
    assert (stats.hit_tokens, stats.blocks_read) == (6, 1)
    s.prefill(prompt)
    assert_close(s.last_logits, cold(lm, prompt)[0])
    with pytest.raises(SnapshotError, match="block 1"):
        Session(lm, block_size=BS).restore(path, ids[:20])


def test_snapshot_of_a_model_with_one_changed_weight_is_refused(llama, tiny_model_dir, tmp_path):
    p, q = prompt_parts(llama, 3 * BS)
    path = tmp_path / "a.kv"
    save_prefix(llama, p, path)
    other = load_model(str(perturbed_copy(tiny_model_dir("llama"), tmp_path / "b", delta=1e-3)), device="cpu")
    assert other.layout == llama.layout

    s = live_session(other, tmp_path)
    before = session_state(s)
    with pytest.raises(ForeignSnapshotError, match="another model"):
        s.restore(path, p + q)
    assert_same_state(before, session_state(s))

    # Control: an unchanged copy of the same model in another folder is the same model.
    import shutil

    same = load_model(str(shutil.copytree(tiny_model_dir("llama"), tmp_path / "copy")), device="cpu")
    assert Session(same, block_size=BS).restore(path, p + q).hit_tokens == len(p)


def test_snapshot_of_another_dtype_is_refused(tiny_lm, tmp_path):
    lm = tiny_lm("llama")
    p, q = prompt_parts(lm, 3 * BS)
    path = tmp_path / "a.kv"
    save_prefix(lm, p, path)
    bf16 = tiny_lm("llama", "bfloat16")
    s = live_session(bf16, tmp_path)
    before = session_state(s)
    with pytest.raises(ForeignSnapshotError, match="bfloat16"):
        s.restore(path, p + q)
    assert_same_state(before, session_state(s))


def test_snapshot_of_another_architecture_is_refused(tiny_lm, tmp_path):
    p, q = prompt_parts(tiny_lm("llama"), 3 * BS)
    path = tmp_path / "a.kv"
    save_prefix(tiny_lm("llama"), p, path)
    with pytest.raises(ForeignSnapshotError):
        Session(tiny_lm("qwen2"), block_size=BS).restore(path, p + q)


def test_snapshot_of_another_namespace_is_refused(llama, tmp_path):
    p, q = prompt_parts(llama, 3 * BS)
    path = tmp_path / "a.kv"
    save_prefix(llama, p, path, namespace="alice")
    s = Session(llama, block_size=BS, namespace="bob")
    s.prefill(p[:5])
    before = session_state(s)
    with pytest.raises(ForeignSnapshotError, match="namespace"):
        s.restore(path, p + q)
    assert_same_state(before, session_state(s))
    assert Session(llama, block_size=BS, namespace="alice").restore(path, p + q).hit_tokens == len(p)


# ---------------------------------------------------------------------------------------------
# Chat


def test_chat_two_turns_reuse_and_messages_survive_a_snapshot(llama, forward_counter, tmp_path):
    lm = llama
    params = SamplingParams(temperature=0, max_new_tokens=6)
    s = Session(lm, block_size=BS)
    first_prompt = s.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}])
    r1 = s.chat("Hello", params, system="Be brief.")
    assert r1.hit_tokens == 0 and r1.prompt_tokens == len(first_prompt)
    counter = forward_counter(lm)
    r2 = s.chat("How are you today?", params)
    assert r2.hit_tokens >= len(first_prompt)
    assert r2.prefill_tokens == r2.prompt_tokens - r2.hit_tokens
    assert counter.tokens == r2.prefill_tokens + max(r2.new_tokens - 1, 0)
    roles = [m["role"] for m in s.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert s.messages[-1]["content"] == r2.text and s.messages[2]["content"] == r1.text

    path = tmp_path / "chat.kv"
    s.save(path)
    with Snapshot(path) as snap:
        assert [dict(m) for m in snap.meta.messages] == s.messages

    resumed = Session(lm, block_size=BS)
    resumed.restore(path)  # no prompt: the whole snapshot, messages included
    assert resumed.messages == s.messages
    assert resumed.tokens == s.tokens
    r3 = resumed.chat("And tomorrow?", params)
    assert r3.hit_tokens > r2.prompt_tokens
    # The same third turn in the original session gives the same answer.
    assert s.chat("And tomorrow?", params).text == r3.text


def test_chat_without_a_template_is_a_config_error(llama, monkeypatch):
    monkeypatch.setattr(llama.tokenizer, "chat_template", None)
    with pytest.raises(ConfigError, match="chat template"):
        Session(llama).chat("hi", GREEDY)


# ---------------------------------------------------------------------------------------------
# Sampling, streaming, stop strings, EOS


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_new_tokens": -1},
        {"temperature": -0.1},
        {"top_k": -1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_p": -0.2},
    ],
)
def test_sampling_params_validation(kwargs):
    with pytest.raises(ConfigError):
        SamplingParams(**kwargs)


def test_sampling_params_edges_are_valid():
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=0.5).greedy
    SamplingParams(max_new_tokens=0, top_k=0, top_p=1.0)


@pytest.mark.parametrize(
    "kwargs", [{"block_size": 0}, {"chunk_size": 0}, {"codec": "lz4"}], ids=["block", "chunk", "codec"]
)
def test_session_settings_validation(kwargs, llama):
    with pytest.raises(ConfigError):
        Session(llama, **kwargs)


def test_session_misuse_is_a_config_error(llama):
    s = Session(llama)
    with pytest.raises(ConfigError, match="empty"):
        s.prefill([])
    with pytest.raises(ConfigError, match="prefill"):
        s.generate(GREEDY)


def test_sample_respects_top_k_and_top_p():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    assert sample(logits, SamplingParams(temperature=0), None) == int(logits.argmax())
    assert sample(logits, SamplingParams(temperature=5.0, top_k=1), g) == int(logits.argmax())
    assert sample(logits, SamplingParams(temperature=1.0, top_p=1e-6), g) == int(logits.argmax())

    top5 = set(torch.topk(logits, 5).indices.tolist())
    draws = {sample(logits, SamplingParams(temperature=2.0, top_k=5), g) for _ in range(300)}
    assert draws <= top5 and len(draws) > 1

    probs = torch.softmax(logits, -1)
    sorted_probs, order = torch.sort(probs, descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs
    nucleus = set(order[before < 0.6].tolist())
    assert 2 < len(nucleus) < 20
    draws = {sample(logits, SamplingParams(temperature=1.0, top_p=0.6), g) for _ in range(300)}
    assert draws <= nucleus and len(draws) > 1


def test_seeded_sampling_is_reproducible(llama):
    lm = llama
    p, _ = prompt_parts(lm, 2 * BS + 5)

    def gen(seed):
        s = Session(lm, block_size=BS)
        s.prefill(p)
        params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=seed, max_new_tokens=12)
        return s.generate(params).token_ids

    assert gen(123) == gen(123)
    assert len({gen(seed) for seed in range(1, 6)}) > 1
    assert len(gen(None)) == 12


def test_text_stream_holds_back_a_possible_stop_string(llama):
    tok = llama.tokenizer
    ids = token_ids(llama, "Hello world. The end")
    stream = TextStream(tok, stop=("world.",))
    out = ""
    for i in ids:
        out += stream.push(i)
        assert "wor" not in out  # a possible start of the stop string is never emitted early
        if stream.stopped:
            break
    out += stream.flush()
    assert stream.stopped and out == "Hello " and stream.text == "Hello "


def test_text_stream_without_stop_emits_everything(llama):
    tok = llama.tokenizer
    text = "Héllo wörld, naïve café 🙂 done"
    stream = TextStream(tok)
    out = "".join(stream.push(i) for i in token_ids(llama, text)) + stream.flush()
    assert out == text and not stream.stopped


def test_stop_string_stops_generation(llama):
    lm = llama
    p, _ = prompt_parts(lm, 2 * BS + 5)
    long = SamplingParams(temperature=0, max_new_tokens=16)
    s = Session(lm, block_size=BS)
    s.prefill(p)
    full = s.generate(long)
    text = full.text
    # A stop string taken from the middle of the greedy text, first occurring there.
    stop = next(
        text[k : k + 2]
        for k in range(3, len(text) - 2)
        if "\ufffd" not in text[: k + 2] and text.find(text[k : k + 2]) == k
    )
    s = Session(lm, block_size=BS)
    s.prefill(p)
    pieces: list[str] = []
    gen = s.generate(dataclasses.replace(long, stop=(stop,)), on_text=pieces.append)
    assert gen.stop_reason == "stop"
    assert gen.text == text[: text.find(stop)]
    assert "".join(pieces) == gen.text
    assert len(gen.token_ids) < len(full.token_ids)
    assert gen.token_ids == full.token_ids[: len(gen.token_ids)]


def test_streamed_text_equals_the_final_text(llama):
    s = Session(llama, block_size=BS)
    s.prefill(prompt_parts(llama, 16)[0])
    pieces: list[str] = []
    gen = s.generate(SamplingParams(temperature=0, max_new_tokens=16), on_text=pieces.append)
    assert "".join(pieces) == gen.text


def test_eos_ends_generation_and_stays_pending(llama, tmp_path):
    p, _ = prompt_parts(llama, 2 * BS + 5)
    _, cold_tokens = cold(llama, p)
    eos = cold_tokens[3]
    assert eos not in cold_tokens[:3]
    lm = dataclasses.replace(llama, eos_token_ids=frozenset({eos}))
    s = Session(lm, block_size=BS)
    s.prefill(p)
    gen = s.generate(GREEDY)
    assert gen.stop_reason == "eos" and gen.token_ids == cold_tokens[:4]
    assert s.pending == [eos] and len(s.tokens) == len(p) + 3
    assert s.save(tmp_path / "e.kv").flushed_tokens == 1
    assert_invariants(s)


# ---------------------------------------------------------------------------------------------
# Interrupts (Ctrl-C) keep the session consistent


def test_interrupt_during_decode_keeps_a_consistent_session(llama):
    lm = llama
    p, _ = prompt_parts(lm, 2 * BS + 5)
    _, cold_tokens = cold(lm, p, SamplingParams(temperature=0, max_new_tokens=12))
    s = Session(lm, block_size=BS)
    s.prefill(p)
    calls = 0

    def on_text(_):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt

    gen = s.generate(SamplingParams(temperature=0, max_new_tokens=12), on_text=on_text)
    assert gen.stop_reason == "interrupted"
    # The token whose text was being shown when Ctrl-C came is kept (pending), not dropped.
    assert lm.tokenizer.decode(list(gen.token_ids), skip_special_tokens=True) == gen.text
    assert gen.token_ids == cold_tokens[: len(gen.token_ids)]
    assert_invariants(s)
    assert len(s.pending) <= 1
    assert tuple(s.all_tokens[len(p) :]) == gen.token_ids
    rest = s.generate(SamplingParams(temperature=0, max_new_tokens=12 - len(gen.token_ids)))
    assert gen.token_ids + rest.token_ids == cold_tokens


def test_error_in_a_stream_callback_leaves_the_session_as_before(llama):
    """Only Ctrl-C ends decoding cleanly; any other error must not leave KV the session does not account for."""
    lm = llama
    p, _ = prompt_parts(lm, 2 * BS + 5)
    _, cold_tokens = cold(lm, p)
    s = Session(lm, block_size=BS)
    s.prefill(p)
    before = session_state(s)
    calls = 0

    def on_text(_):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise BrokenPipeError("stdout closed")

    with pytest.raises(BrokenPipeError):
        s.generate(GREEDY, on_text=on_text)
    assert_invariants(s)
    assert_same_state(before, session_state(s))
    assert s.generate(GREEDY).token_ids == cold_tokens


def test_error_inside_a_layer_during_flush_keeps_the_pending_tokens(llama, tmp_path):
    lm = llama
    p, _ = prompt_parts(lm, 2 * BS + 5)
    s = Session(lm, block_size=BS)
    s.prefill(p)
    s.generate(SamplingParams(temperature=0, max_new_tokens=3))
    before = session_state(s)
    assert len(s.pending) == 1

    def boom(module, args, kwargs):
        raise RuntimeError("device lost")

    handle = lm.model.model.layers[1].register_forward_pre_hook(boom, with_kwargs=True)
    try:
        with pytest.raises(RuntimeError, match="device lost"):
            s.save(tmp_path / "x.kv")
    finally:
        handle.remove()
    assert not (tmp_path / "x.kv").exists()
    assert_invariants(s)
    assert_same_state(before, session_state(s))
    assert s.save(tmp_path / "x.kv").flushed_tokens == 1
    assert_restores_bit_exact(lm, tmp_path / "x.kv", s)


def test_interrupt_inside_a_layer_during_decode_crops_every_layer(llama):
    lm = llama
    p, _ = prompt_parts(lm, 2 * BS + 5)
    _, cold_tokens = cold(lm, p, SamplingParams(temperature=0, max_new_tokens=12))
    s = Session(lm, block_size=BS)
    s.prefill(p)
    calls = 0

    def boom(module, args, kwargs):
        nonlocal calls
        calls += 1
        if calls == 4:  # the fourth decode step, after layer 0 already ran
            raise KeyboardInterrupt

    handle = lm.model.model.layers[1].register_forward_pre_hook(boom, with_kwargs=True)
    try:
        gen = s.generate(SamplingParams(temperature=0, max_new_tokens=12))
    finally:
        handle.remove()
    assert gen.stop_reason == "interrupted"
    assert gen.token_ids == cold_tokens[:4] and gen.forwarded == 3
    assert_invariants(s)
    assert s.pending == [cold_tokens[3]]
    rest = s.generate(SamplingParams(temperature=0, max_new_tokens=8))
    assert gen.token_ids + rest.token_ids == cold_tokens


def test_interrupt_inside_a_layer_during_prefill_crops_every_layer(llama):
    """Ctrl-C in the middle of a forward: layer 0 already grew, layer 1 did not; the session cuts both back."""
    lm = llama
    p, q = prompt_parts(lm, 2 * BS)
    cold_logits, cold_tokens = cold(lm, p + q)
    s = Session(lm, block_size=BS, chunk_size=5)
    s.prefill(p)
    calls = 0

    def boom(module, args, kwargs):
        nonlocal calls
        calls += 1
        if calls == 2:  # the second chunk of the suffix, after layer 0 ran
            raise KeyboardInterrupt

    handle = lm.model.model.layers[1].register_forward_pre_hook(boom, with_kwargs=True)
    try:
        with pytest.raises(KeyboardInterrupt):
            s.prefill(p + q)
    finally:
        handle.remove()
    assert s.tokens == p
    assert_invariants(s)
    s.prefill(p + q)
    assert_close(s.last_logits, cold_logits)
    assert s.generate(GREEDY).token_ids == cold_tokens


def test_interrupt_between_chunks_keeps_the_reused_prefix(llama):
    lm = llama
    p, q = prompt_parts(lm, 2 * BS)
    cold_logits, _ = cold(lm, p + q)
    s = Session(lm, block_size=BS, chunk_size=3)
    s.prefill(p)

    def stop_after_first(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        s.prefill(p + q, on_progress=stop_after_first)
    assert s.tokens == p
    assert_invariants(s)
    plan, seen = s.prefill(p + q)
    assert plan.hit_tokens == len(p) and seen == len(q)
    assert_close(s.last_logits, cold_logits)
