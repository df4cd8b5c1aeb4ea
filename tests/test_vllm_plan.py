"""The vLLM connector's scheduler-side plan (kvsnap/integrations/vllm_plan.py), without vLLM: which
tokens a request loads from the store into which vLLM blocks, and which full blocks each step saves.
The boundaries are the bugs worth pinning: the prompt's last token is never loaded, loads cover whole
vLLM blocks, saves whole store blocks, and a prompt prefilled in chunks is saved chunk by chunk."""

from __future__ import annotations

import pytest

from kvsnap.integrations.vllm_plan import Planner, ScheduledRequest

PROMPT = tuple(range(1000, 2000))  # 1,000 token ids


def new(req_id: str, num_computed: int, num_scheduled: int, blocks: list[int]) -> ScheduledRequest:
    return ScheduledRequest(req_id, num_computed, num_scheduled, blocks, True)


def running(req_id: str, num_computed: int, num_scheduled: int, blocks: list[int] | None = None) -> ScheduledRequest:
    return ScheduledRequest(req_id, num_computed, num_scheduled, blocks, False)


def test_a_hit_counts_whole_store_blocks_beyond_what_vllm_holds():
    plan = Planner(128, 32)
    assert plan.matched("r", PROMPT, "", stored_blocks=7, num_computed=0) == 896
    assert plan.matched("r", PROMPT, "", stored_blocks=7, num_computed=256) == 640  # vLLM's own prefix cache first
    assert plan.matched("r", PROMPT, "", stored_blocks=7, num_computed=896) == 0
    assert plan.matched("r", PROMPT, "", stored_blocks=0, num_computed=0) == 0


def test_the_prompts_last_token_is_never_loaded():
    """vLLM computes at least the last prompt token, for the first logits: a prompt stored whole loads
    up to the last whole vLLM block before that token."""
    plan = Planner(64, 32)
    assert plan.matched("a", tuple(range(192)), "", stored_blocks=3, num_computed=0) == 160
    assert plan.matched("b", tuple(range(193)), "", stored_blocks=3, num_computed=0) == 192
    assert Planner(128, 128).matched("c", tuple(range(1024)), "", stored_blocks=8, num_computed=0) == 896


def test_a_load_names_its_token_range_vllm_blocks_and_the_store_blocks_it_reads():
    plan = Planner(128, 32)
    assert plan.matched("r", PROMPT, "ns", stored_blocks=3, num_computed=64) == 320
    blocks = list(range(100, 132))  # 32 vLLM blocks: 1,024 tokens
    plan.allocated("r", blocks, 320)
    loads, saves = plan.step([new("r", 384, 616, blocks)])
    (load,) = loads
    assert (load.start, load.end, load.namespace) == (64, 384, "ns")
    assert load.block_ids == tuple(blocks[:12])  # covers [0, 384): the loaded blocks are 2..11
    assert load.token_ids == PROMPT[:384]  # 3 store blocks read
    (save,) = saves  # the rest of the prompt's full blocks, computed this step
    assert save.token_ids == PROMPT[:896] and save.block_ids == tuple(blocks[:28])
    assert plan.step([running("r", 1000, 1)]) == ([], [])  # decoding saves nothing more


def test_a_prompt_prefilled_in_chunks_is_saved_chunk_by_chunk():
    plan = Planner(128, 32)
    assert plan.matched("r", PROMPT, "", stored_blocks=0, num_computed=0) == 0
    first = list(range(16))
    plan.allocated("r", first, 0)
    loads, saves = plan.step([new("r", 0, 512, first)])
    assert loads == [] and [s.token_ids for s in saves] == [PROMPT[:512]]
    more = list(range(16, 32))
    _, saves = plan.step([running("r", 512, 300, more)])  # ends at 812: two more whole blocks, to 768
    assert [(len(s.token_ids), s.block_ids) for s in saves] == [(768, tuple(range(24)))]
    _, saves = plan.step([running("r", 812, 188)])
    assert [len(s.token_ids) for s in saves] == [896]


def test_blocks_the_store_holds_already_are_not_planned_again():
    plan = Planner(128, 128)
    plan.matched("r", PROMPT, "", stored_blocks=7, num_computed=896)  # vLLM holds them too: nothing to load
    plan.allocated("r", list(range(8)), 0)
    assert plan.step([new("r", 896, 104, list(range(8)))]) == ([], [])


def test_a_request_resumed_after_preemption_gets_its_new_blocks():
    plan = Planner(128, 128)
    plan.matched("r", PROMPT, "", stored_blocks=0, num_computed=0)
    plan.allocated("r", list(range(8)), 0)
    plan.step([new("r", 0, 256, list(range(8)))])
    # Preempted, then scheduled again: vLLM asks again and gives it other blocks.
    plan.matched("r", PROMPT, "", stored_blocks=2, num_computed=0)
    plan.allocated("r", list(range(50, 58)), 256)
    loads, saves = plan.step([ScheduledRequest("r", 256, 744, list(range(50, 58)), True)])
    assert [(x.start, x.end, x.block_ids) for x in loads] == [(0, 256, (50, 51))]
    assert [(len(s.token_ids), s.block_ids) for s in saves] == [(896, tuple(range(50, 57)))]


def test_requests_without_a_lookup_are_left_alone_and_finish_forgets():
    plan = Planner(128, 128)
    plan.allocated("never-looked-up", [1, 2, 3], 0)
    assert plan.step([new("never-looked-up", 0, 300, [1, 2, 3])]) == ([], [])
    plan.matched("r", PROMPT, "", stored_blocks=0, num_computed=0)
    plan.allocated("r", list(range(8)), 0)
    assert plan.num_requests == 1
    plan.finish("r")
    plan.finish("r")
    assert plan.num_requests == 0 and plan.step([new("r", 0, 1000, list(range(8)))]) == ([], [])


def test_the_last_answer_before_allocation_counts():
    """vLLM may ask again (the request could not be scheduled at first): the load matches the last answer."""
    plan = Planner(128, 128)
    plan.matched("r", PROMPT, "", stored_blocks=7, num_computed=0)
    plan.matched("r", PROMPT, "", stored_blocks=2, num_computed=0)
    plan.allocated("r", list(range(8)), 256)
    loads, _ = plan.step([new("r", 256, 744, list(range(8)))])
    assert [(x.start, x.end) for x in loads] == [(0, 256)]


def test_the_store_block_size_must_be_a_multiple_of_vllms():
    with pytest.raises(ValueError, match="multiple"):
        Planner(100, 32)
