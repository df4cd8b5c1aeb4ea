"""Verifying a reuse: snapshots and store blocks record what made their KV, and a spot check recomputes one
restored block when asked, or when that record differs from the running versions or device.

A snapshot whose KV is changed after saving and re-signed (every checksum recomputed, so the file passes
every integrity check) must be caught by --verify; matching versions must cost no extra forward.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import kvsnap
from core_helpers import rewrite_meta
from typer.testing import CliRunner

from kvsnap import provenance
from kvsnap.config import SamplingParams
from kvsnap.engine import verify
from kvsnap.engine.session import Session
from kvsnap.errors import VerifyError
from kvsnap.format import Snapshot, encode_block, write_snapshot
from kvsnap.models import load_model
from kvsnap.store import BlockStore
from kvsnap.store.index_json import index_from_json, index_to_json
from kvsnap_cli.main import app

ROOT = Path(__file__).resolve().parents[1]
BS = 8
GREEDY = SamplingParams(max_new_tokens=4, temperature=0)
runner = CliRunner()


def ids(n: int, start: int = 5) -> list[int]:
    return list(range(start, start + n))


def saved(lm, path: Path, n: int = 40) -> Path:
    s = Session(lm, block_size=BS)
    s.prefill(ids(n))
    s.save(path)
    return path


def perturb_and_resign(path: Path, block: int, delta: float = 0.5) -> None:
    """Add ``delta`` to every K/V value of one block, then write the file again through the writer:
    block checksums, hashes and the metadata checksum all match the changed bytes."""
    with Snapshot(path) as snap:
        meta, tokens, logits = snap.meta, list(snap.tokens), snap.last_logits()
        raws = [bytes(r) for r in snap.read_raw(range(len(meta.blocks)))]
    values = np.frombuffer(raws[block], dtype=np.float32) + np.float32(delta)
    raws[block] = values.astype(np.float32).tobytes()
    blocks = [
        encode_block(raw, b.num_tokens, b.hash, meta.layout.itemsize, meta.codec, meta.level)
        for raw, b in zip(raws, meta.blocks)
    ]
    write_snapshot(path, meta.header, tokens, blocks, last_logits=logits, messages=meta.messages)
    with Snapshot(path) as snap:
        assert snap.verify() == []  # sound by every integrity check


def shift_last_layer_v_and_resign(path: Path, block: int, delta: float) -> None:
    """Add ``delta`` to the last layer's V of one block only (K/V of the layers before it as they were),
    re-signed as ``perturb_and_resign`` does. That V feeds no later layer of any position: only the
    attention of the last layer over it, and so the logits."""
    with Snapshot(path) as snap:
        meta, tokens, logits = snap.meta, list(snap.tokens), snap.last_logits()
        raws = [bytes(r) for r in snap.read_raw(range(len(meta.blocks)))]
    values = np.frombuffer(raws[block], dtype=np.float32).copy().reshape(meta.layout.num_layers, 2, -1)
    values[-1, 1] += np.float32(delta)
    raws[block] = values.tobytes()
    blocks = [
        encode_block(raw, b.num_tokens, b.hash, meta.layout.itemsize, meta.codec, meta.level)
        for raw, b in zip(raws, meta.blocks)
    ]
    write_snapshot(path, meta.header, tokens, blocks, last_logits=logits, messages=meta.messages)
    with Snapshot(path) as snap:
        assert snap.verify() == []


class _Draw:
    """A stand-in for ``verify.RANDOM`` that draws ``block``."""

    def __init__(self, block: int):
        self.block = block

    def randrange(self, start: int, stop: int) -> int:
        assert start <= self.block < stop
        return self.block


def set_recorded(path: Path, **changes: str | None) -> None:
    """Edit the recorded ``made_by`` of a snapshot (None removes the record), re-signing the metadata."""

    def mutate(meta: dict) -> None:
        if changes.get("made_by", "") is None:
            meta["extra"].pop("made_by", None)
            return
        meta["extra"]["made_by"].update(changes)

    rewrite_meta(path, mutate)


def test_snapshots_record_what_made_them_and_inspect_shows_it(llama, tmp_path):
    snap = saved(llama, tmp_path / "a.kv")
    with Snapshot(snap) as s:
        made = s.meta.extra["made_by"]
    assert made == verify.running_made_by(llama) and set(made) == set(provenance.KEYS)
    info = json.loads(runner.invoke(app, ["inspect", str(snap), "--json"]).stdout)
    assert info["made_by"] == made
    shown = runner.invoke(app, ["inspect", str(snap)]).stdout
    assert f"transformers {made['transformers']} (native forward) on cpu" in " ".join(shown.split())
    set_recorded(snap, made_by=None)
    assert "not recorded" in runner.invoke(app, ["inspect", str(snap)]).stdout


def test_verify_catches_kv_changed_after_saving_and_resigned(llama, tmp_path):
    snap = saved(llama, tmp_path / "a.kv")
    perturb_and_resign(snap, block=4)  # the last full block of 40 tokens: the one --verify recomputes
    prompt = ids(40) + [70, 71, 72]
    with pytest.raises(VerifyError, match="differs from a recompute"):
        Session(llama, block_size=BS, verify=True).run(prompt, GREEDY, resume=snap)
    result = Session(llama, block_size=BS, verify=True, on_mismatch="recompute").run(prompt, GREEDY, resume=snap)
    assert result.verify is not None and not result.verify["passed"]
    assert result.verify_max_abs_diff == pytest.approx(0.5, rel=1e-3)
    assert "differs from a recompute" in result.restore_error
    assert result.hit_tokens == 0 and result.prefill_tokens == len(prompt)
    assert result.text == Session(llama, block_size=BS).run(prompt, GREEDY).text
    # Without the check the changed KV is trusted: that is what the check is for.
    assert Session(llama, block_size=BS, verify=False).run(prompt, GREEDY, resume=snap).hit_tokens == 40


def test_verify_passes_sound_kv_at_the_cost_of_the_blocks_it_checks(llama, tmp_path, forward_counter, monkeypatch):
    snap = saved(llama, tmp_path / "a.kv", n=43)  # 5 full blocks and a partial tail of 3 tokens
    prompt = ids(43) + [70, 71]
    monkeypatch.setattr(verify, "RANDOM", _Draw(3))
    counter = forward_counter(llama)
    result = Session(llama, block_size=BS, verify=True).run(prompt, GREEDY, resume=snap)
    # The first block, one drawn between, and the partial tail (reused like any block): each at every layer.
    assert result.verify["passed"] and result.verify["reason"] == "requested"
    assert result.verify["blocks"] == [0, 3, 5] and result.verify["positions"] == [[0, 8], [24, 32], [40, 43]]
    # A recompute sums in another order than the 43-token prefill that made the blocks: within 1e-5.
    assert result.verify_max_abs_diff < 1e-5 and result.verify["logits_max_abs_diff"] < 1e-5
    assert result.verify["stored_logits_max_abs_diff"] < 1e-5  # the file's last logits, checked too
    assert result.verify_s > 0 and result.restore_error is None and result.hit_tokens == 43
    checked = (8 + 2) + (8 + 2) + (3 + 2)  # each block's prefill and two one-token forwards
    assert result.verify["tokens"] == checked
    assert counter.tokens == result.prefill_tokens + result.new_tokens - 1 + checked


@pytest.mark.parametrize("block", [0, 2])
def test_verify_catches_an_earlier_blocks_last_layer_changed_and_resigned(llama, tmp_path, monkeypatch, block):
    """The last layer's V of an earlier block feeds no layer a recompute of the last block computes, and
    the logits over it are the same KV both times: only recomputing that block itself shows it. The
    first block is always checked; a block between is when it is the one drawn."""
    snap = saved(llama, tmp_path / "a.kv")  # 5 blocks
    shift_last_layer_v_and_resign(snap, block, 3.0)
    monkeypatch.setattr(verify, "RANDOM", _Draw(2))
    prompt = ids(30) + [70, 71, 72]  # leaves the snapshot inside block 3: no stored logits to compare
    unchecked = Session(llama, block_size=BS, verify=False).run(prompt, GREEDY, resume=snap)
    assert unchecked.hit_tokens == 30 and unchecked.text != Session(llama, block_size=BS).run(prompt, GREEDY).text
    end = (block + 1) * BS - 1
    with pytest.raises(
        VerifyError, match=rf"block {block} \(tokens {block * BS}-{end}\) differs from a recompute by 3"
    ):
        Session(llama, block_size=BS, verify=True).run(prompt, GREEDY, resume=snap)
    again = Session(llama, block_size=BS, verify=True, on_mismatch="recompute").run(prompt, GREEDY, resume=snap)
    assert not again.verify["passed"] and again.verify["block"] == block and block in again.verify["blocks"]
    assert again.text == Session(llama, block_size=BS).run(prompt, GREEDY).text


def test_verify_catches_a_changed_partial_tail_block(llama, tmp_path):
    snap = saved(llama, tmp_path / "a.kv", n=43)
    perturb_and_resign(snap, block=5)  # the 3-token tail
    prompt = ids(43) + [70, 71]
    with pytest.raises(VerifyError, match="block 5 .*differs from a recompute"):
        Session(llama, block_size=BS, verify=True).run(prompt, GREEDY, resume=snap)


def test_verify_catches_changed_stored_logits(llama, tmp_path):
    """A prompt the snapshot holds whole starts decoding from the file's last logits, with no forward:
    a file whose logits were changed (and re-signed) must not make the answer."""
    snap = saved(llama, tmp_path / "a.kv", n=43)
    with Snapshot(snap) as s:
        meta, tokens, logits = s.meta, list(s.tokens), s.last_logits()
        blocks = [s.encoded_block(i, bytes(s.read_stored(i))) for i in range(len(meta.blocks))]
    forged = logits.copy()
    forged[int(forged.argmin())] = forged.max() + 50.0  # another token wins the greedy pick
    write_snapshot(snap, meta.header, tokens, blocks, last_logits=forged, messages=meta.messages)
    unchecked = Session(llama, block_size=BS, verify=False).run(ids(43), GREEDY, resume=snap)
    assert unchecked.logits_source == "snapshot"  # what the check is for: the forged logits are used
    with pytest.raises(VerifyError, match="stored logits"):
        Session(llama, block_size=BS, verify=True).run(ids(43), GREEDY, resume=snap)
    again = Session(llama, block_size=BS, verify=True, on_mismatch="recompute").run(ids(43), GREEDY, resume=snap)
    assert again.text == Session(llama, block_size=BS).run(ids(43), GREEDY).text


def test_matching_versions_run_no_extra_forward(llama, tmp_path, forward_counter):
    snap = saved(llama, tmp_path / "a.kv")
    prompt = ids(40) + [70, 71, 72]
    counter = forward_counter(llama)
    session = Session(llama, block_size=BS)
    seen = session.runner.tokens_seen
    result = session.run(prompt, GREEDY, resume=snap)
    assert result.verify is None and result.verify_s is None and result.hit_tokens == 40
    assert counter.tokens == session.runner.tokens_seen - seen == result.prefill_tokens + result.new_tokens - 1


def test_a_recorded_version_change_runs_the_check_by_itself(llama, tmp_path, forward_counter):
    snap = saved(llama, tmp_path / "a.kv")
    set_recorded(snap, transformers="4.0.0")
    prompt = ids(40) + [70, 71, 72]
    counter = forward_counter(llama)
    result = Session(llama, block_size=BS).run(prompt, GREEDY, resume=snap)
    assert result.verify is not None and result.verify["passed"]
    assert result.verify["reason"].startswith("transformers 4.0.0 -> ")
    assert counter.tokens == result.prefill_tokens + result.new_tokens - 1 + (BS + 2)
    perturb_and_resign(snap, block=4)  # keeps the edited record: the automatic check now catches it
    with pytest.raises(VerifyError, match="checked because: transformers 4.0.0"):
        Session(llama, block_size=BS).run(prompt, GREEDY, resume=snap)


def test_a_snapshot_without_a_record_is_checked(llama, tmp_path):
    snap = saved(llama, tmp_path / "a.kv")
    set_recorded(snap, made_by=None)
    result = Session(llama, block_size=BS).run(ids(40) + [70], GREEDY, resume=snap)
    assert result.verify["reason"] == "versions not recorded"


def test_a_save_keeps_an_unchecked_foreign_record(llama, tmp_path):
    """Resaving KV other versions made must not relabel it as this version's, unless a check vouched for it."""
    snap = saved(llama, tmp_path / "a.kv")
    set_recorded(snap, transformers="4.0.0")
    s = Session(llama, block_size=BS, verify=False)
    s.run(ids(40) + [70], GREEDY, resume=snap)
    s.save(tmp_path / "b.kv")
    with Snapshot(tmp_path / "b.kv") as b:
        assert b.meta.extra["made_by"]["transformers"] == "4.0.0"
    checked = Session(llama, block_size=BS)
    checked.run(ids(40) + [70], GREEDY, resume=snap)
    checked.save(tmp_path / "c.kv")
    with Snapshot(tmp_path / "c.kv") as c:
        assert c.meta.extra["made_by"] == verify.running_made_by(llama)


def test_store_blocks_record_what_made_them_and_a_change_is_checked(llama, tmp_path, monkeypatch, forward_counter):
    store = BlockStore(tmp_path / "store")
    prompt = ids(40) + [70, 71]
    Session(llama, block_size=BS, store=store).run(prompt, GREEDY)
    index = store.read_index()
    running = provenance.encode(verify.running_made_by(llama))
    assert {r.made_by for r in index.blocks.values()} == {running}
    data = index_to_json(index)
    assert data["made_by"] == [json.loads(running)] and all(b["made_by"] == 0 for b in data["blocks"])
    again = index_from_json(data)
    assert {r.made_by for r in again.blocks.values()} == {running}
    assert next(iter(again.chains.values())).parts == tuple(sorted(llama.fingerprint_parts.items()))
    assert store.tree()["roots"][0]["children"][0]["made_by"] == [json.loads(running)]

    counter = forward_counter(llama)
    same = Session(llama, block_size=BS, store=store).run(prompt, GREEDY)
    assert same.restored_from == "store" and same.verify is None
    assert counter.tokens == same.prefill_tokens + same.new_tokens - 1

    newer = {**verify.running_made_by(llama), "transformers": "99.0"}
    monkeypatch.setattr(verify, "running_made_by", lambda lm: newer)
    result = Session(llama, block_size=BS, store=store).run(prompt, GREEDY)
    assert result.restored_from == "store" and result.verify["passed"]
    assert "-> 99.0" in result.verify["reason"] and result.verify["block"] == 4


def test_an_index_without_records_still_loads(llama, tmp_path):
    store = BlockStore(tmp_path / "store")
    Session(llama, block_size=BS, store=store).run(ids(24), GREEDY)
    data = index_to_json(store.read_index())
    data.pop("made_by")
    for b in data["blocks"]:
        b.pop("made_by")
    for c in data["chains"]:
        c.pop("fingerprint_parts")
    index = index_from_json(data)
    assert {r.made_by for r in index.blocks.values()} == {""} and index.check() == []


def test_bfloat16_kv_passes_its_own_check(tiny_lm, tmp_path):
    lm = tiny_lm("llama", "bfloat16")
    snap = saved(lm, tmp_path / "b.kv")
    result = Session(lm, block_size=BS, verify=True).run(ids(40) + [70], GREEDY, resume=snap)
    assert result.verify["passed"] and result.verify["tolerance"] == verify.TOLERANCE["bfloat16"]


def test_run_verify_flag_refuses_or_recomputes(tiny_model_dir, llama, tmp_path):
    text = "Once upon a time there was a small cache that kept every key and value it had ever seen."
    tokens = list(llama.tokenizer(text, add_special_tokens=False)["input_ids"])
    prompt = text + " The quick brown fox."
    assert list(llama.tokenizer(prompt, add_special_tokens=False)["input_ids"])[: len(tokens)] == tokens
    s = Session(llama, block_size=BS)
    s.prefill(tokens)
    s.save(tmp_path / "a.kv")
    perturb_and_resign(tmp_path / "a.kv", block=len(tokens) // BS - 1)
    args = ["run", "--model", str(tiny_model_dir("llama")), "--device", "cpu", "--block-size", str(BS)]
    args += ["--prompt", prompt, "--resume", str(tmp_path / "a.kv"), "--max-new-tokens", "2", "--reuse", "load"]
    refused = runner.invoke(app, [*args, "--verify"])
    assert refused.exit_code == 1 and "differs from a recompute" in refused.stderr and "Traceback" not in refused.output
    row = json.loads(runner.invoke(app, [*args, "--verify", "--on-mismatch", "recompute", "--json"]).stdout)
    assert row["verify"]["passed"] is False and row["hit_tokens"] == 0 and "recompute" in row["restore_error"]
    assert runner.invoke(app, [*args, "--no-verify", "--json"]).exit_code == 0
    shown = runner.invoke(app, [*args, "--verify", "--on-mismatch", "recompute"])
    last = -(-len(tokens) // BS) - 1  # the last block restored, a partial tail included
    assert "verified blocks 0, " in shown.stderr and f"{last:,}, every layer" in shown.stderr
    assert "refused" in shown.stderr


def test_chat_recomputes_a_conversation_whose_kv_fails_the_check(llama, tiny_model_dir, tmp_path):
    s = Session(llama, block_size=BS)
    s.chat("hello there", SamplingParams(max_new_tokens=12, temperature=0, stop_loops=False))
    s.save(tmp_path / "chat.kv")
    perturb_and_resign(tmp_path / "chat.kv", block=len(s.tokens) // BS - 1)
    args = ["chat", "--model", str(tiny_model_dir("llama")), "--device", "cpu"]
    args += ["--block-size", str(BS), "--resume", str(tmp_path / "chat.kv"), "--max-new-tokens", "2", "--verify"]
    # --reuse load: under auto, a calibration taken on a busy machine may find recomputing the tiny
    # model's prefix faster, and then nothing is reused and nothing checked (this test flaked so).
    args += ["--reuse", "load"]
    refused = kvsnap(*args, "--on-mismatch", "error", input="and now?\n")
    assert refused.returncode == 1 and "differs from a recompute" in refused.stderr
    kept = kvsnap(*args, "--on-mismatch", "recompute", input="and now?\n")
    assert kept.returncode == 0, kept.stderr
    assert "the conversation is kept and its KV computed again" in kept.stderr
    with Snapshot(tmp_path / "chat.kv") as after:
        assert len(after.meta.messages) == 4  # the earlier turn and the new one


def test_kv_made_through_transformers_classes_is_checked_when_the_native_forward_resumes_it(
    tiny_model_dir, llama, tmp_path, monkeypatch
):
    """made_by names the forward that computed the KV: a snapshot from transformers' classes
    (KVSNAP_NATIVE=0, or a model the native forward does not take) is spot checked by a native resume."""
    monkeypatch.setenv("KVSNAP_NATIVE", "0")
    theirs = load_model(str(tiny_model_dir("llama")), device="cpu")
    assert theirs.backend == "transformers" and llama.backend == "native"
    snap = saved(theirs, tmp_path / "t.kv")
    with Snapshot(snap) as s:
        assert s.meta.extra["made_by"]["forward"] == "transformers"
    result = Session(llama, block_size=BS).run(ids(40) + [70], GREEDY, resume=snap)
    assert result.verify["passed"] and "forward transformers -> native" in result.verify["reason"]
