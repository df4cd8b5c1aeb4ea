"""Prefix match, suffix chunk plan and reuse ledger: the off-by-boundary cases, one by one."""

from __future__ import annotations

import random

import pytest
from core_helpers import FINGERPRINT, NAMESPACE

from kvsnap import hashing
from kvsnap.prefix import Ledger, Match, chunk_ranges, common_prefix_len, match_prefix, plan_prefill

BS = 4
STORED = list(range(1000, 1014))  # 14 tokens: 3 full blocks of 4 and a partial tail of 2


def _match(prompt, stored=STORED, block_size=BS) -> Match:
    root = hashing.chain_root(FINGERPRINT, NAMESPACE, block_size)
    stored_hashes = hashing.chain_hashes(stored, block_size, root)
    m = match_prefix(prompt, stored, stored_hashes, block_size, root)
    # Whatever the case, the reused prefix must be tokens the snapshot really holds.
    assert list(prompt[: m.hit_tokens]) == list(stored[: m.hit_tokens])
    assert m.full_blocks * block_size <= m.hit_tokens
    return m


# ---------------------------------------------------------------------------------------------
# match_prefix


def test_no_hit():
    m = _match([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert (m.hit_tokens, m.full_blocks, m.num_blocks, m.last_block_tokens) == (0, 0, 0, 0)


def test_empty_prompt():
    m = _match([])
    assert (m.hit_tokens, m.full_blocks, m.num_blocks) == (0, 0, 0)


def test_empty_snapshot():
    m = _match(STORED, stored=[])
    assert (m.hit_tokens, m.full_blocks, m.num_blocks) == (0, 0, 0)


def test_hit_ends_exactly_on_a_block_boundary():
    """Divergence at the first token of block 2: two whole blocks, no token-granular tail."""
    m = _match(STORED[:8] + [7, 7, 7, 7, 7])
    assert (m.hit_tokens, m.full_blocks, m.num_blocks, m.last_block_tokens) == (8, 2, 2, 4)


def test_mid_block_divergence_reuses_the_tail_token_by_token():
    m = _match(STORED[:10] + [7, 7, 7, 7])
    assert (m.hit_tokens, m.full_blocks, m.num_blocks, m.last_block_tokens) == (10, 2, 3, 2)


def test_divergence_in_the_first_block():
    m = _match(STORED[:3] + [7] + STORED[4:])
    assert (m.hit_tokens, m.full_blocks, m.num_blocks, m.last_block_tokens) == (3, 0, 1, 3)


def test_later_identical_blocks_do_not_hit_after_a_difference():
    """The chain bakes in position: equal blocks after a difference are not reusable KV."""
    prompt = list(STORED)
    prompt[1] = 7
    m = _match(prompt)
    assert (m.hit_tokens, m.full_blocks) == (1, 0)


@pytest.mark.parametrize(("length", "full"), [(1, 0), (3, 0), (4, 1), (6, 1), (8, 2), (13, 3)])
def test_prompt_shorter_than_the_snapshot(length, full):
    m = _match(STORED[:length])
    assert (m.hit_tokens, m.full_blocks) == (length, full)
    assert m.num_blocks == -(-length // BS)


def test_prompt_equal_to_the_snapshot():
    m = _match(list(STORED))
    assert (m.hit_tokens, m.full_blocks, m.num_blocks, m.last_block_tokens) == (14, 3, 4, 2)


def test_prompt_equal_to_a_snapshot_of_whole_blocks():
    m = _match(STORED[:12], stored=STORED[:12])
    assert (m.hit_tokens, m.full_blocks, m.num_blocks, m.last_block_tokens) == (12, 3, 3, 4)


def test_partial_tail_block_of_the_snapshot_is_reused():
    """The snapshot's partial tail has no hash, yet its tokens are reused one by one."""
    m = _match(STORED + [7, 7, 7, 7, 7])
    assert (m.hit_tokens, m.full_blocks, m.num_blocks, m.last_block_tokens) == (14, 3, 4, 2)
    m = _match(STORED[:13] + [7, 7, 7])
    assert (m.hit_tokens, m.full_blocks, m.num_blocks, m.last_block_tokens) == (13, 3, 4, 1)


def test_prompt_extends_a_snapshot_of_whole_blocks():
    m = _match(STORED[:12] + [7, 7, 7, 7, 7], stored=STORED[:12])
    assert (m.hit_tokens, m.full_blocks, m.num_blocks) == (12, 3, 3)


def test_block_size_one():
    m = _match(STORED[:5] + [7], block_size=1)
    assert (m.hit_tokens, m.full_blocks, m.num_blocks, m.last_block_tokens) == (5, 5, 5, 1)


def test_block_size_must_be_positive():
    root = hashing.chain_root(FINGERPRINT, NAMESPACE, 4)
    with pytest.raises(ValueError):
        match_prefix(STORED, STORED, [], 0, root)


def test_hit_is_the_common_prefix_for_random_sequences():
    """Property: with a consistent chain, the hit is exactly the longest common prefix."""
    rng = random.Random(0)
    for _ in range(400):
        block_size = rng.choice([1, 2, 3, 4, 8])
        stored = [rng.randrange(3) for _ in range(rng.randrange(0, 30))]
        cut = rng.randrange(0, len(stored) + 1)
        prompt = stored[:cut] + [rng.randrange(3) for _ in range(rng.randrange(0, 12))]
        m = _match(prompt, stored=stored, block_size=block_size)
        assert m.hit_tokens == common_prefix_len(prompt, stored), (block_size, stored, prompt)
        assert m.full_blocks == m.hit_tokens // block_size


@pytest.mark.parametrize(
    ("stored", "prompt"),
    [
        ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9]),  # block 1 differs entirely
        ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 9, 8]),  # block 1 differs mid-block
        ([1, 2, 3, 4, 5, 6, 7, 8], [9, 2, 3, 4, 5, 6, 7, 8]),  # block 0 differs, block 1 equal
        ([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 0, 9, 10]),  # last full block, tail after
    ],
)
def test_forced_hash_collision_is_caught_by_the_token_check(monkeypatch, stored, prompt):
    """Every block hashes alike here; a hit may still never cover a token that differs."""
    monkeypatch.setattr(hashing, "block_hash", lambda parent, block_token_ids: b"\x00" * hashing.DIGEST_SIZE)
    root = hashing.chain_root(FINGERPRINT, NAMESPACE, 4)
    stored_hashes = hashing.chain_hashes(stored, 4, root)
    prompt_hashes = hashing.chain_hashes(prompt, 4, root)
    assert prompt_hashes[: len(stored_hashes)] == stored_hashes[: len(prompt_hashes)]  # the collision is real

    m = match_prefix(prompt, stored, stored_hashes, 4, root)

    assert prompt[: m.hit_tokens] == stored[: m.hit_tokens]
    assert m.hit_tokens == common_prefix_len(prompt, stored)
    assert m.full_blocks == m.hit_tokens // 4


def test_forced_collision_on_random_sequences(monkeypatch):
    monkeypatch.setattr(hashing, "block_hash", lambda parent, block_token_ids: b"\x11" * hashing.DIGEST_SIZE)
    root = hashing.chain_root(FINGERPRINT, NAMESPACE, 4)
    rng = random.Random(1)
    for _ in range(200):
        stored = [rng.randrange(2) for _ in range(rng.randrange(0, 25))]
        prompt = [rng.randrange(2) for _ in range(rng.randrange(0, 25))]
        m = match_prefix(prompt, stored, hashing.chain_hashes(stored, 4, root), 4, root)
        assert prompt[: m.hit_tokens] == stored[: m.hit_tokens]
        assert m.hit_tokens == common_prefix_len(prompt, stored)


# ---------------------------------------------------------------------------------------------
# chunk_ranges and plan_prefill


@pytest.mark.parametrize(
    ("start", "end", "chunk_size", "sizes"),
    [
        (0, 12, 4, [4, 4, 4]),  # divides
        (0, 10, 4, [4, 4, 2]),  # does not divide: last one short
        (5, 12, 3, [3, 3, 1]),  # starts mid-sequence
        (5, 11, 3, [3, 3]),
        (0, 5, 1, [1, 1, 1, 1, 1]),  # chunk size 1
        (3, 5, 100, [2]),  # chunk larger than the suffix
        (7, 7, 4, []),  # nothing to run
    ],
)
def test_chunk_ranges(start, end, chunk_size, sizes):
    chunks = chunk_ranges(start, end, chunk_size)
    assert [e - s for s, e in chunks] == sizes
    if chunks:
        assert chunks[0][0] == start and chunks[-1][1] == end
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))  # contiguous, in order


def test_chunk_size_must_be_positive():
    with pytest.raises(ValueError):
        chunk_ranges(0, 10, 0)
    with pytest.raises(ValueError):
        plan_prefill(10, 2, 0, logits_at_hit=False)


def test_chunks_cover_the_suffix_exactly():
    """Guards off-by-boundary chunk ends: every suffix position is run once, in order, none past the end."""
    for prompt_tokens in range(0, 20):
        for hit in range(0, prompt_tokens):
            for chunk_size in range(1, 8):
                plan = plan_prefill(prompt_tokens, hit, chunk_size, logits_at_hit=False)
                positions = [p for s, e in plan.chunks for p in range(s, e)]
                assert positions == list(range(hit, prompt_tokens))
                assert all(0 < size <= chunk_size for size in plan.chunk_sizes)
                assert sum(plan.chunk_sizes) == plan.prefill_tokens


def test_partial_hit_prefills_the_suffix():
    plan = plan_prefill(10, 6, 4, logits_at_hit=True)
    assert plan.logits_source == "prefill"
    assert (plan.hit_tokens, plan.prefill_tokens, plan.chunks) == (6, 4, ((6, 10),))


def test_cold_prompt_prefills_everything():
    plan = plan_prefill(10, 0, 4, logits_at_hit=False)
    assert plan.logits_source == "prefill"
    assert plan.chunk_sizes == [4, 4, 2]
    assert plan.prefill_tokens == 10


def test_full_hit_with_stored_logits_runs_nothing():
    plan = plan_prefill(10, 10, 4, logits_at_hit=True)
    assert plan.logits_source == "snapshot"
    assert (plan.hit_tokens, plan.prefill_tokens, plan.chunks) == (10, 0, ())


def test_full_hit_without_logits_backs_off_one_token():
    plan = plan_prefill(10, 10, 4, logits_at_hit=False)
    assert plan.logits_source == "backoff"
    assert (plan.hit_tokens, plan.prefill_tokens, plan.chunks) == (9, 1, ((9, 10),))


def test_single_token_prompt_full_hit_backs_off_to_zero():
    plan = plan_prefill(1, 1, 4, logits_at_hit=False)
    assert (plan.logits_source, plan.hit_tokens, plan.chunks) == ("backoff", 0, ((0, 1),))


def test_empty_prompt_plans_nothing():
    """Guards a backoff on an empty prompt, which would plan position -1."""
    for logits_at_hit in (False, True):
        plan = plan_prefill(0, 0, 4, logits_at_hit=logits_at_hit)
        assert (plan.hit_tokens, plan.prefill_tokens, plan.chunks) == (0, 0, ())
        assert plan.logits_source == "prefill"


@pytest.mark.parametrize(("prompt_tokens", "hit_tokens"), [(10, 11), (10, -1), (0, 1)])
def test_hit_outside_the_prompt_is_refused(prompt_tokens, hit_tokens):
    with pytest.raises(ValueError):
        plan_prefill(prompt_tokens, hit_tokens, 4, logits_at_hit=False)


# ---------------------------------------------------------------------------------------------
# Ledger


def test_ledger_of_a_partial_hit():
    ledger = Ledger.of(plan_prefill(100, 37, 16, logits_at_hit=False))
    assert ledger == Ledger(prompt_tokens=100, hit_tokens=37, prefill_tokens=63, reuse_ratio=0.37, chunks=4)


def test_ledger_of_a_full_hit_with_snapshot_logits():
    ledger = Ledger.of(plan_prefill(64, 64, 16, logits_at_hit=True))
    assert ledger == Ledger(prompt_tokens=64, hit_tokens=64, prefill_tokens=0, reuse_ratio=1.0, chunks=0)


def test_ledger_of_a_backoff_counts_the_recomputed_token():
    ledger = Ledger.of(plan_prefill(8, 8, 16, logits_at_hit=False))
    assert ledger == Ledger(prompt_tokens=8, hit_tokens=7, prefill_tokens=1, reuse_ratio=0.875, chunks=1)


def test_ledger_of_an_empty_prompt_and_a_cold_one():
    assert Ledger.of(plan_prefill(0, 0, 16, logits_at_hit=False)) == Ledger(0, 0, 0, 0.0, 0)
    assert Ledger.of(plan_prefill(33, 0, 16, logits_at_hit=False)) == Ledger(33, 0, 33, 0.0, 3)


def test_ledger_takes_the_prefill_count_the_runner_saw():
    ledger = Ledger.of(plan_prefill(10, 4, 4, logits_at_hit=False), prefill_tokens=5)
    assert (ledger.hit_tokens, ledger.prefill_tokens, ledger.chunks) == (4, 5, 2)


def test_ledger_ratio_is_rounded():
    ledger = Ledger.of(plan_prefill(3, 1, 4, logits_at_hit=False))
    assert ledger.reuse_ratio == 0.333333
