"""The block store behind Session and `kvsnap run/chat --store`: runs reuse each other's prefixes."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from kvsnap.config import SamplingParams
from kvsnap.engine.session import Session
from kvsnap.store import BlockStore, interchange
from kvsnap_cli.main import app

GREEDY = SamplingParams(max_new_tokens=6, temperature=0)


def test_second_run_reuses_the_first_runs_blocks_and_matches_cold(llama, tmp_path, forward_counter):
    store = BlockStore(tmp_path / "store")
    shared = list(range(5, 45))  # 40 tokens: 5 blocks of 8
    first = Session(llama, block_size=8, store=store).run(shared + [50, 51], GREEDY)
    assert first.hit_tokens == 0 and first.store_new_blocks == 5

    prompt = shared + [60, 61, 62]
    counter = forward_counter(llama)
    resumed_session = Session(llama, block_size=8, store=store, chunk_size=2)
    resumed = resumed_session.run(prompt, GREEDY)
    assert resumed.restored_from == "store" and resumed.hit_tokens == 40
    assert resumed.prefill_tokens == 3
    assert counter.tokens == 3 + resumed.new_tokens - 1  # suffix, then one token per decode step

    cold_session = Session(llama, block_size=8)
    cold = cold_session.run(prompt, GREEDY)
    assert resumed.text == cold.text
    # the restored KV is bitwise what a cold prefill computes for those positions
    for a, b in zip(resumed_session.cache.layers, cold_session.cache.layers):
        assert torch.allclose(a.keys[..., :40, :], b.keys[..., :40, :], atol=1e-5)


def test_other_namespace_never_hits_the_store(llama, tmp_path):
    store = BlockStore(tmp_path / "store")
    prompt = list(range(5, 45))
    Session(llama, block_size=8, store=store, namespace="alice").run(prompt, GREEDY)
    bob = Session(llama, block_size=8, store=store, namespace="bob").run(prompt, GREEDY)
    assert bob.hit_tokens == 0
    alice = Session(llama, block_size=8, store=store, namespace="alice").run(prompt, GREEDY)
    assert alice.hit_tokens > 0


def test_file_resume_and_store_take_the_longer_prefix(llama, tmp_path):
    store = BlockStore(tmp_path / "store")
    prompt = list(range(5, 70))
    Session(llama, block_size=8, store=store).run(prompt[:48], SamplingParams(max_new_tokens=0))
    short = Session(llama, block_size=8)
    short.prefill(prompt[:20])
    short.save(tmp_path / "short.kv")
    result = Session(llama, block_size=8, store=store).run(prompt, GREEDY, resume=tmp_path / "short.kv")
    assert result.restored_from == "store" and result.hit_tokens == 48


def test_cli_batch_through_a_store_with_a_budget(tiny_model_dir, tmp_path):
    model = str(tiny_model_dir("llama"))
    doc = "Blocks of tokens are hashed in a chain, so a prefix is found by its last block alone. " * 4
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(
        "\n".join(json.dumps({"id": i, "prompt": doc + q, "max_new_tokens": 2}) for i, q in enumerate("ABC"))
    )
    store = tmp_path / "store"
    args = [
        "run",
        "--model",
        model,
        "--device",
        "cpu",
        "--block-size",
        "16",
        "--batch",
        str(jobs),
        "--store",
        str(store),
    ]
    result = CliRunner().invoke(app, [*args, "--store-budget", "10MB"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert rows[0]["hit_tokens"] == 0
    assert all(r["hit_tokens"] >= 0.8 * r["prompt_tokens"] and r["restored_from"] == "store" for r in rows[1:])
    stats = BlockStore(store).stats()
    assert stats["hits"] >= 2 and stats["bytes"] <= 10_000_000
    assert CliRunner().invoke(app, ["run", "--model", model, "--prompt", "x", "--store-budget", "1MB"]).exit_code == 1


def test_named_chat_session_in_the_store_pins_and_exports(llama, tmp_path):
    store = BlockStore(tmp_path / "store")
    session = Session(llama, block_size=8, store=store)
    session.chat("hello there, this is a test of the store", GREEDY, store_session="mine")
    session.chat("and a second turn", GREEDY, store_session="mine")
    [record] = [s for s in store.sessions() if s.name == "mine"]
    store.pin("mine")
    out = tmp_path / "mine.kv"
    interchange.export_session(store, "mine", out)
    resumed = Session(llama, block_size=8)
    resumed.restore(out)
    assert resumed.tokens == session.tokens and resumed.messages == session.messages
    third = resumed.chat("a third turn", GREEDY)
    # At least the conversation up to the last answer (a random model's answer may re-tokenize differently).
    assert third.hit_tokens >= len(session.render_chat(session.messages[:-1]))
    assert record.pinned is False and any(s.pinned for s in store.sessions() if s.name == "mine")
