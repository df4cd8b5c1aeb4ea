"""The load-or-recompute cost model kept on disk is input like any other file: whatever is at its path,
a run goes on (the damaged file is as if absent), it is measured at most once per process, and never
before a refusal that does not need it."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
from typer.testing import CliRunner

from kvsnap.config import SamplingParams
from kvsnap.engine import calibrate, costs
from kvsnap.engine.session import Session
from kvsnap.reuse import CostModel, decide
from kvsnap_cli.main import app

GOOD = {"key": "", "prefill": [[64, 0.01], [256, 0.04]], "load_bytes_per_s": 1e9, "load_overhead_s": 0.001}


def _with(**changes):
    return json.dumps({**GOOD, **changes})


DAMAGED = {
    "deeply nested": "[" * 100_000 + "]" * 100_000,
    "infinity": _with(prefill=[[64, "Infinity"]]).replace('"Infinity"', "Infinity"),
    "infinite tokens": _with(prefill=[[1e400, 0.01]]).replace("inf", "1e400"),
    "nan": _with(load_bytes_per_s=float("nan")),
    "negative seconds": _with(prefill=[[64, -1.0]]),
    "absurd rate": _with(load_bytes_per_s=1e300),
    "zero rate": _with(load_bytes_per_s=0),
    "not an object": "[1, 2, 3]",
    "truncated": _with()[:30],
    "binary": "\x00\xff" * 100,
}


@pytest.fixture
def lm(tiny_lm):
    return tiny_lm("llama")


@pytest.mark.parametrize("kind", sorted(DAMAGED))
def test_a_damaged_cost_model_is_absent(lm, kind):
    path = costs.cache_path(lm)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = DAMAGED[kind]
    if kind not in ("deeply nested", "not an object", "truncated", "binary"):
        text = text.replace('"key": ""', f'"key": "{costs.machine_key(lm)}"')
    path.write_text(text)
    assert costs.cached(lm) is None


def test_a_sound_cost_model_is_read_back(lm):
    path = costs.cache_path(lm)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_with(key=costs.machine_key(lm)))
    model = costs.cached(lm)
    assert isinstance(model, CostModel) and model.load_bytes_per_s == 1e9


def test_a_fifo_or_a_folder_at_the_path_neither_hangs_nor_fails(lm):
    path = costs.cache_path(lm)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    result: list[object] = []
    reader = threading.Thread(target=lambda: result.append(costs.cached(lm)), daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive() and result == [None]  # a FIFO with no writer would block a plain open
    path.unlink()
    path.mkdir()
    assert costs.cached(lm) is None


def test_measured_once_per_process_where_it_cannot_be_kept(lm, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the calibration folder would be")
    monkeypatch.setenv("KVSNAP_CALIBRATION", str(blocker))
    measured = []
    real = calibrate.calibrate
    monkeypatch.setattr(calibrate, "calibrate", lambda lm, **kw: measured.append(1) or real(lm, **kw))
    first = calibrate.cost_model(lm)
    assert calibrate.cost_model(lm) == first and measured == [1]
    assert not costs.kept_on_disk(lm) and blocker.read_text().startswith("a file")


def test_a_symlink_at_the_path_is_not_written_through(lm, tmp_path):
    target = tmp_path / "elsewhere.json"
    target.write_text("mine")
    path = costs.cache_path(lm)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)
    calibrate.calibrate(lm)
    assert target.read_text() == "mine" and not costs.kept_on_disk(lm)


def _prime(model: str, snap, *extra: str) -> None:
    args = ["run", "--model", model, "--device", "cpu", "--block-size", "16", "--max-new-tokens", "0"]
    result = CliRunner().invoke(app, [*args, "--prompt", "one two three " * 20, "--save", str(snap), *extra])
    assert result.exit_code == 0, result.output


def test_a_run_over_a_damaged_cache_measures_says_so_and_answers(tiny_model_dir, tmp_path, lm):
    model = str(tiny_model_dir("llama"))
    snap = tmp_path / "d.kv"
    _prime(model, snap)
    path = costs.cache_path(lm)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(DAMAGED["deeply nested"])
    args = ["run", "--model", model, "--device", "cpu", "--block-size", "16", "--resume", str(snap), "--json"]
    out = CliRunner().invoke(app, [*args, "--prompt", "one two three " * 21, "--max-new-tokens", "2"])
    assert out.exit_code == 0, out.output
    assert "measuring load vs recompute for this model and dtype" in out.stderr
    assert json.loads(out.stdout)["reuse_decision"] in ("load", "recompute")
    again = CliRunner().invoke(app, [*args, "--prompt", "one two three " * 21, "--max-new-tokens", "2"])
    assert again.exit_code == 0 and "measuring load" not in again.stderr  # kept this time


def test_no_measuring_before_a_refusal_or_without_a_decision(tiny_model_dir, tmp_path):
    model = str(tiny_model_dir("llama"))
    snap = tmp_path / "f32.kv"
    _prime(model, snap)
    base = ["run", "--model", model, "--device", "cpu", "--block-size", "16", "--max-new-tokens", "1"]
    # Another dtype's snapshot is another model's KV: refused, and nothing measured first.
    refused = CliRunner().invoke(app, [*base, "--dtype", "bfloat16", "--prompt", "one", "--resume", str(snap)])
    assert refused.exit_code == 1 and "measuring load" not in refused.stderr
    # A prompt that shares nothing with the snapshot has nothing to decide on.
    other = CliRunner().invoke(app, [*base, "--prompt", "zebra " * 30, "--resume", str(snap)])
    assert other.exit_code == 0 and "measuring load" not in other.stderr, other.output
    # --reuse load and recompute decide without costs.
    load = CliRunner().invoke(app, [*base, "--prompt", "one two three " * 21, "--resume", str(snap), "--reuse", "load"])
    assert load.exit_code == 0 and "measuring load" not in load.stderr


def test_a_library_session_never_measures_on_its_own(lm, tmp_path, forward_counter):
    s = Session(lm, block_size=16)
    s.prefill(list(range(5, 70)))
    s.save(tmp_path / "a.kv")
    counter = forward_counter(lm)
    again = Session(lm, block_size=16)
    result = again.run(list(range(5, 75)), SamplingParams(max_new_tokens=1, temperature=0), resume=tmp_path / "a.kv")
    assert result.reuse_decision == "load" and "not calibrated" in result.reuse_reason
    assert counter.tokens == 5  # the suffix alone (one new token needs no forward): no measurement ran


def test_a_smaller_context_is_measured_at_the_models_own_lengths(tiny_model_dir):
    """A chat with --ctx-size 256 resuming a file measured the cost model first, and its 1,024-token
    prefill was refused as more than the context asked for: the resume ended in that error."""
    from kvsnap.models import load_model

    small = load_model(str(tiny_model_dir("llama")), device="cpu", ctx_size=256)
    model = calibrate.calibrate(small)
    assert [n for n, _ in model.prefill] == list(calibrate.LENGTHS)
    assert small.max_positions == 256 and costs.cached(small) == model


def test_a_slow_prefill_is_timed_once_and_longer_lengths_are_not_measured(llama, monkeypatch, forward_counter):
    """An 8B model on 2 CPU cores took over 20 minutes to calibrate at every length twice before its first
    resume: once a prefill is long and loading clearly cheaper, longer lengths cannot turn the decision."""
    real = calibrate.Session.prefill

    def slow(self, *args, **kwargs):
        time.sleep(0.3)  # a model this slow to prefill; its restores stay the tiny model's
        return real(self, *args, **kwargs)

    monkeypatch.setattr(calibrate.Session, "prefill", slow)
    monkeypatch.setattr(calibrate, "LONG_S", 0.2)
    counter = forward_counter(llama)
    model = calibrate.calibrate(llama)
    assert [n for n, _ in model.prefill] == [calibrate.LENGTHS[0]] and len(model.loads) == 1
    assert counter.tokens == calibrate.LENGTHS[0]  # one timed prefill, not REPEATS
    assert decide("auto", 64, model.loads[0][1], model).decision == "load"
