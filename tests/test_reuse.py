"""Load or recompute a stored prefix (--reuse): the decision, its cost model, and an unchanged output."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvsnap.config import SamplingParams
from kvsnap.engine import calibrate, costs
from kvsnap.engine.session import Session
from kvsnap.errors import ConfigError
from kvsnap.models import load_model
from kvsnap.reuse import CostModel, decide
from kvsnap_cli.main import app

GREEDY = SamplingParams(max_new_tokens=8, temperature=0)


def fake(prefill_per_token_s: float, load_bytes_per_s: float, overhead_s: float = 0.0) -> CostModel:
    return CostModel(
        "fake", ((64, 64 * prefill_per_token_s), (1024, 1024 * prefill_per_token_s)), load_bytes_per_s, overhead_s
    )


def test_auto_loads_only_where_loading_is_predicted_faster():
    fast_gpu = fake(prefill_per_token_s=1e-5, load_bytes_per_s=1e8, overhead_s=0.002)  # 0.01 s per 1k tokens
    assert decide("auto", 1024, 50_000_000, fast_gpu).decision == "recompute"  # 0.5 s to read 50 MB
    assert decide("auto", 1024, 100_000, fast_gpu).decision == "load"
    slow_cpu = fake(prefill_per_token_s=2e-3, load_bytes_per_s=1e9, overhead_s=0.002)
    for tokens in (16, 64, 4096):
        d = decide("auto", tokens, tokens * 40_000, slow_cpu)
        assert d.decision == "load" and d.predicted_load_s < d.predicted_recompute_s
    assert decide("load", 16, 10**12, fast_gpu).decision == "load"
    assert decide("recompute", 16, 1, slow_cpu).decision == "recompute"
    assert decide("auto", 16, 1, None).decision == "load"  # not calibrated: load, and say so
    with pytest.raises(ConfigError):
        decide("sometimes", 1, 1, None)


def test_cost_model_interpolates_and_survives_json():
    model = CostModel("k", ((64, 0.1), (256, 0.5)), 1e9, 0.01, ((64, 1000, 0.011),))
    assert model.prefill_s(0) == 0 and model.prefill_s(64) == pytest.approx(0.1)
    assert model.prefill_s(160) == pytest.approx(0.3) and model.prefill_s(448) == pytest.approx(0.9)
    assert CostModel.from_json(json.loads(json.dumps(model.to_json()))) == model
    with pytest.raises(ValueError):
        CostModel.from_json({"key": "k", "prefill": [], "load_bytes_per_s": 1, "load_overhead_s": 0})


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    return load_model(str(tiny_model_dir("llama")), device="cpu")


@pytest.fixture
def primed(lm, tmp_path):
    ids = list(range(5, 105))
    s = Session(lm, block_size=16)
    s.prefill(ids[:80])
    s.save(tmp_path / "p.kv")
    return ids, tmp_path / "p.kv"


def test_the_decision_never_changes_the_output(lm, primed, monkeypatch):
    """Recompute and load give the same tokens; the ledger says which was done and why."""
    ids, path = primed
    loaded = Session(lm, block_size=16, reuse="load").run(ids, GREEDY, resume=path)
    recomputed = Session(lm, block_size=16, reuse="recompute").run(ids, GREEDY, resume=path)
    assert loaded.text == recomputed.text
    assert (loaded.reuse_decision, loaded.hit_tokens) == ("load", 80)
    assert (recomputed.reuse_decision, recomputed.hit_tokens, recomputed.prefill_tokens) == ("recompute", 0, 100)
    # auto, driven by a fake cost model in which recomputing is cheap (a fast GPU, a small model)
    monkeypatch.setattr(costs, "cached", lambda lm: fake(1e-9, 1.0, 1.0))
    # (a library call never measures by itself: without a cost model, auto loads)
    auto = Session(lm, block_size=16).run(ids, GREEDY, resume=path)
    assert auto.reuse_decision == "recompute" and auto.text == loaded.text
    assert auto.predicted_load_s > auto.predicted_recompute_s and "predicted" in auto.reuse_reason


def test_a_chat_that_recomputes_keeps_its_messages(lm, tmp_path):
    s = Session(lm, block_size=16)
    s.chat("first message", GREEDY)
    s.save(tmp_path / "c.kv")
    again = Session(lm, block_size=16, reuse="recompute")
    again.restore(tmp_path / "c.kv")
    assert again.messages == s.messages and again.tokens == []
    assert again.chat("second", GREEDY).prefill_tokens > len(s.tokens)


def test_calibration_is_measured_once_and_cached(lm, kvsnap_home):
    costs.cache_path(lm).unlink(missing_ok=True)
    seen = Session(lm).runner.tokens_seen
    first = calibrate.cost_model(lm)
    assert first.loads and first.prefill and costs.cache_path(lm).is_file()
    counter = {"calls": 0}
    real = calibrate.calibrate
    try:
        calibrate.calibrate = lambda *a, **k: counter.__setitem__("calls", counter["calls"] + 1)
        assert calibrate.cost_model(lm) == first and counter["calls"] == 0
    finally:
        calibrate.calibrate = real
    assert seen == 0


def test_cli_reuse_flag_and_calibrate_command(tiny_model_dir, tmp_path):
    model = str(tiny_model_dir("llama"))
    runner = CliRunner()
    base = ["--model", model, "--device", "cpu", "--block-size", "16"]
    snap = tmp_path / "d.kv"
    assert (
        runner.invoke(
            app, ["run", *base, "--prompt", "one two three " * 20, "--max-new-tokens", "0", "--save", str(snap)]
        ).exit_code
        == 0
    )
    out = runner.invoke(
        app, ["run", *base, "--prompt", "one two three " * 21, "--resume", str(snap), "--reuse", "recompute", "--json"]
    )
    assert out.exit_code == 0, out.output
    row = json.loads(out.stdout)
    assert row["reuse_decision"] == "recompute" and row["hit_tokens"] == 0
    bad = runner.invoke(app, ["run", *base, "--prompt", "x", "--reuse", "maybe"])
    assert bad.exit_code == 1 and "--reuse must be" in bad.stderr
    measured = runner.invoke(app, ["calibrate", "--model", model, "--device", "cpu", "--json"])
    assert measured.exit_code == 0, measured.output
    info = json.loads(measured.stdout)
    assert [r["tokens"] for r in info["rows"]] == [64, 256, 1024] and info["load_bytes_per_s"] > 0
