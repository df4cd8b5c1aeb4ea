"""The benchmark scripts run end to end (on a tiny model, tiny sizes) and their figures hang together.

Not a timing test: no figure here is compared with a speed. What is checked is that each script
finishes, writes its JSON where it is told, and that what it reports is consistent (the resume
really reused the prefix, an incremental save encoded only the new block, the device check passed).
Each script runs as ``__main__`` in this process (``run_script``, conftest.py); the new processes
the scripts start for their own figures are started as they always are.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.bench


@pytest.fixture
def bench(tmp_path, kvsnap_home, run_script):
    results = tmp_path / "results"

    def run(script: str, *args: str) -> tuple[str, dict]:
        env = {"KVSNAP_HOME": str(kvsnap_home), "KVSNAP_BENCH_RESULTS": str(results)}
        proc = run_script(ROOT / "benchmarks" / f"{script}.py", *args, env=env)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return proc.stdout, json.loads((results / f"{script}.json").read_text())

    return run


def test_resume_benchmark(bench, tiny_model_dir):
    # The script itself asserts that every resumed run reused the 128-token prefix and ran only the suffix.
    out, data = bench("resume", "--model", str(tiny_model_dir("llama")), "--lengths", "160", "--repeats", "1")
    assert out.startswith("machine: ")
    (row,) = data["rows"]
    assert row["tokens"] == 160 and data["codec"] == "shuffle-zstd"
    # The snapshot holds the 128-token prefix, compressed: smaller than the raw KV it holds.
    assert 0 < row["file_bytes"] < row["kv_bytes"]
    keys = ("in_memory_ttft_s", "new_process_cold_ttft_s", "new_process_resumed_ttft_s", "new_process_st_load_s")
    for key in (*keys, "new_process_prefetched_ttft_s"):
        assert row[key] > 0, key


def test_resume_benchmark_refuses_a_length_that_leaves_no_room_for_the_answer(
    tiny_model_dir, kvsnap_home, tmp_path, run_script
):
    # The tiny model's context is 4096 tokens: a 4096-token prompt has no position left for the
    # answer's first token, so no TTFT exists. Refused before any work, not after minutes of it.
    env = {"KVSNAP_HOME": str(kvsnap_home), "KVSNAP_BENCH_RESULTS": str(tmp_path)}
    args = ["--model", str(tiny_model_dir("llama")), "--lengths", "160", "4096"]
    proc = run_script(ROOT / "benchmarks" / "resume.py", *args, env=env)
    assert proc.returncode == 2 and "shorter than the model's context (4096)" in proc.stderr, proc.stderr[-2000:]
    assert not list(tmp_path.iterdir())


def test_restore_levers_benchmark_times_every_variant_per_codec(bench, tiny_model_dir):
    out, data = bench("restore_levers", "--model", str(tiny_model_dir("llama")), "--lengths", "200", "--repeats", "1")
    assert out.startswith("machine: ")
    assert [(r["tokens"], r["codec"]) for r in data["rows"]] == [(200, "shuffle-zstd"), (200, "raw")]
    for row in data["rows"]:
        assert row["read_s"] > 0
        for name in ("before", "arena", "now"):
            assert row[f"{name}_s"] > 0 and row[f"{name}_vs_read"] > 0, name


def test_crossover_benchmark(bench, tiny_model_dir):
    out, data = bench("crossover", "--model", str(tiny_model_dir("llama")), "--lengths", "64", "128", "--repeats", "1")
    rows = data["rows"]
    assert [r["tokens"] for r in rows] == [64, 128]
    # The verdict agrees with the rows it summarises.
    if all(r["load_s"] < r["recompute_s"] for r in rows):
        assert data["verdict"].startswith("loading wins at every length")
    else:
        assert not data["verdict"].startswith("loading wins at every length")


def test_save_benchmark_encodes_only_the_new_block(bench, tiny_model_dir):
    _, data = bench("save", "--model", str(tiny_model_dir("llama")), "--history", "256", "--turn", "16")
    (row,) = data["rows"]
    # 256 + 16 tokens: 4 full blocks were encoded by the first save, only the new tail block now.
    assert row["blocks"] == 5 and row["new_blocks"] == 1
    assert row["store_new_blocks"] == 1


def test_autosave_benchmark_times_both_ways(bench, tiny_model_dir):
    out, data = bench("autosave", "--model", str(tiny_model_dir("llama")), "--history", "128", "--repeats", "1")
    assert out.startswith("machine: ")
    (row,) = data["rows"]
    assert row["history"] > 128 and row["file_mb"] > 0
    for key in ("inline_prompt_s", "background_prompt_s", "background_save_s"):
        assert row[key] > 0, key


def test_chunked_benchmark(bench, tiny_model_dir):
    _, data = bench(
        "chunked", "--model", str(tiny_model_dir("llama")), "--tokens", "64", "--chunks", "16", "64", "--repeats", "1"
    )
    assert sorted(r["chunk"] for r in data["rows"]) == [16, 64]
    # Peaks are read per process; every row names one (a tiny prefill may add nothing measurable).
    assert all(r["peak_mb"] > 0 and r["tok_s"] > 0 for r in data["rows"])


def test_device_check_passes_on_cpu(bench, tiny_model_dir):
    out, data = bench("cuda_check", "--model", str(tiny_model_dir("llama")), "--device", "cpu", "--tokens", "160")
    # The device-independent checks: bitwise restore, the same answer, only the suffix run.
    assert "FAIL" not in out
    assert out.count("PASS") == 3 and all(data["checks"].values())
    assert data["figures"]["first_restore_s"] > 0


def test_shaped_model_has_the_shapes_and_tokenizer_of_its_source(tmp_path, tiny_model_dir, kvsnap_home, run_script):
    """The GPU check's stand-in model: the source's config and tokenizer, new random weights."""
    src = tiny_model_dir("llama")
    small, built = tmp_path / "small", tmp_path / "built"
    script = ROOT / "benchmarks" / "shaped_model.py"
    import torch

    with torch.random.fork_rng(devices=[]):  # the build seeds torch's generator: not for the tests after it
        for args in (["--export", str(small), "--model", str(src)], [str(small), str(built)]):
            proc = run_script(script, *args, env={"KVSNAP_HOME": str(kvsnap_home)})
            assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (small / "model.safetensors").exists()  # only the small files travel
    from kvsnap.models import load_model

    a, b = load_model(str(src)), load_model(str(built))
    assert a.layout == b.layout and a.fingerprint_parts["tokenizer"] == b.fingerprint_parts["tokenizer"]
    assert a.fingerprint_parts["weights"] != b.fingerprint_parts["weights"]
    assert a.tokenizer("river city")["input_ids"] == b.tokenizer("river city")["input_ids"]


def test_serve_benchmark_reuses_across_a_restart_only_with_the_store(bench, tiny_model_dir):
    args = ("--model", str(tiny_model_dir("llama")), "--device", "cpu", "--block-size", "16", "--max-tokens", "2")
    out, data = bench("serve", *args)
    assert out.startswith("machine: ")
    on, off = data["store_on"], data["store_off"]
    assert len(on) == 12 and [r["prompt"] for r in on] == [r["prompt"] for r in off]
    # The first request after the restart: the store still holds its conversation; memory holds only
    # the warm-up request, which shares a token or two of the chat template with it.
    first = next(i for i, r in enumerate(on) if r["after_restart"])
    assert on[first]["cached"] >= on[first - 3]["prompt"] // 16 * 16 > 0 and off[first]["cached"] < 16
    assert data["totals"]["after"]["cached_on"] > data["totals"]["after"]["cached_off"]
    assert all(r["ttft_s"] > 0 for r in on + off)


def test_chat_quality_benchmark(bench, tiny_model_dir):
    out, data = bench(
        "chat_quality", "--model", str(tiny_model_dir("llama")), "--seeds", "2", "--max-new-tokens", "4",
        "--settings", "greedy", "t0.2 p0.9",
    )  # fmt: skip
    rows = {r["setting"]: r for r in data["rows"]}
    assert rows["greedy"]["answers"] == 5 and rows["t0.2 p0.9"]["answers"] == 10  # greedy needs one seed
    assert all(0 <= r["correct"] <= 1 for r in rows.values()) and "correct" in out


def test_chat_reuse_benchmark_reuses_every_token_with_kv(bench, tiny_model_dir, tmp_path):
    out, data = bench(
        "chat_reuse", "--model", str(tiny_model_dir("llama")), "--turns", "3", "--seeds", "2", "--max-new-tokens", "6",
        "--temperature", "1.5",
    )  # fmt: skip
    *seeds, total = data["rows"]
    assert [r["seed"] for r in seeds] == [0, 1] and total["seed"] == "all"
    # Only the answer's last sampled token, which has no KV yet, is run again.
    assert total["share_of_kv"] == 1.0 and total["previous_tokens"] - total["reused_tokens"] == 2 * 2
    assert total["rerender_share"] <= total["reused_share"] and "reused of previous turn" in out
    # Seeds run apart print one table together.
    apart = tmp_path / "seeds.json"
    apart.write_text(json.dumps(data))
    _, combined = bench("chat_reuse", "--combine", str(apart), str(apart))
    assert combined["rows"][-1]["previous_tokens"] == 2 * total["previous_tokens"]


def test_startup_benchmark_times_each_stage_of_a_new_process(bench, tiny_model_dir):
    args = ("--model", str(tiny_model_dir("llama")), "--device", "cpu", "--lengths", "160", "--repeats", "1")
    out, data = bench("startup", *args)
    assert out.startswith("machine: ")
    (label,) = data["trees"]
    summary = data["summary"]["160"]
    resume, cold = summary[f"{label} resume"], summary[f"{label} cold"]
    for stage in ("interpreter", "cli imports", "load: torch", "load: weights", "session", "prefill", "exit"):
        assert resume[stage]["median"] > 0 and cold[stage]["median"] > 0, stage
    assert resume["restore"]["median"] > cold.get("restore", {"median": 0})["median"]  # cold: nothing to read
    # The stages of one process add up to no more than its wall time.
    for run in data["runs"]:
        parts = sum(v for k, v in run["stages"].items() if k not in ("total", "cpu") and not k.startswith("="))
        assert 0 < parts <= run["stages"]["total"] * 1.01


def test_packing_benchmark_compares_packed_and_unpacked_forwards(bench, tiny_model_dir):
    out, data = bench(
        "packing", "--model", str(tiny_model_dir("llama")), "--lengths", "100", "--repeats", "2", "--chunk", "40"
    )
    assert out.startswith("machine: ")
    (row,) = data["rows"]
    assert row["tokens"] == 100 and row["chunk_tokens"] == 40 and data["pack_s"] > 0
    for name in ("unpacked", "packed"):
        assert row[f"{name}_suffix_s"] > 0 and row[f"{name}_chunk_s"] > 0 and row[f"{name}_decode_s"] > 0
        assert row[f"{name}_linear_ms"] > 0  # the profile found the linear layers of both (mm or oneDNN)


def test_decode_benchmark_reports_tokens_per_second_per_variant(bench, tiny_model_dir):
    args = ("--model", str(tiny_model_dir("llama")), "--lengths", "48", "--new-tokens", "6", "--repeats", "2")
    variants = ("chat", "float32-unpacked", "float32-unpacked-general")
    out, data = bench("decode", *args, "--variant", *variants, "--profile")
    assert out.startswith("machine: ") and "decode tokens/s" in out and "2 threads" in out
    rates = [r["tok_per_s"] for r in data["runs"]]
    assert len(rates) == 3 * 2 and all(rate > 0 for rate in rates)
    # No --llama-site: llama.cpp is left out, not an error.
    assert {r["engine"] for r in data["runs"]} == {f"kvsnap {v}" for v in variants}
    assert all(r["new_tokens"] == 6 and r["load_average"] >= 0 for r in data["runs"])
    assert data["threads"] == 2 and data["load_average"]["min"] <= data["load_average"]["max"]
    assert "general forward for a step" in out  # what the variant without the decode step ran, named
    # A profile per variant: time and operator calls per token; the decode step makes fewer calls.
    profiles = data["profiles"]
    assert set(profiles) == {f"kvsnap {v}" for v in variants}
    assert all(p["ms_per_token"] > 0 and p["top"] for p in profiles.values())
    step, general = profiles["kvsnap float32-unpacked"], profiles["kvsnap float32-unpacked-general"]
    assert step["calls_per_token"] < general["calls_per_token"]


def test_context_shift_benchmark_times_both_ways_and_finds_the_rotation_exact(bench, tiny_model_dir):
    args = ("--model", str(tiny_model_dir("llama")), "--contexts", "256", "--answer", "8", "--repeats", "1")
    out, data = bench("context_shift", *args)
    assert out.startswith("machine: ")
    (row,) = data["rows"]
    assert row["shift"] == "measured" and row["dropped_turns"] > 0 and row["prompt_tokens"] <= 128
    assert row["recompute_s"] > 0 and row["shift_s"] > 0 and row["recompute_equals_cold"]
    # Layer 0's KV depends on the token alone: a right rotation leaves only rounding there.
    assert row["k_diff_layer0"] < 1e-4 * max(1.0, row["k_max_abs"])
    assert 0 <= row["same_answer_tokens"] <= row["answer_tokens"] == 8


def test_sealed_benchmark_restores_plain_and_sealed(bench, tiny_model_dir):
    # The script itself checks that each restore gave back the document's tokens.
    out, data = bench("sealed", "--model", str(tiny_model_dir("llama")), "--lengths", "160", "--repeats", "1")
    assert out.startswith("machine: ")
    (row,) = data["rows"]
    assert row["tokens"] == 160 and row["sealed_file_mb"] > row["file_mb"]
    for key in ("plain_restore_s", "sealed_restore_s", "plain_save_s", "sealed_save_s"):
        assert row[key] > 0, key


def test_agent_loop_benchmark_reuses_the_fixed_prefix_and_more_with_the_store(bench, tiny_model_dir):
    # The tiny model's own template takes no tools: the script swaps in a tool template and says so.
    args = ("--model", str(tiny_model_dir("qwen2")), "--device", "cpu", "--block-size", "16")
    out, data = bench("agent_loop", *args, "--steps", "2", "--schema-tokens", "200", "--arguments", "1")
    assert out.startswith("machine: ") and "the model's own takes no tools" in data["template"]
    first, second = data["rows"]
    whole = data["fixed_prefix_tokens"] // 16 * 16
    assert whole > 0 and second["prompt"] > first["prompt"]
    # Cold reuses nothing; memory only from the second step; the store from the first step on.
    assert first["cold_cached"] == second["cold_cached"] == 0 and first["memory_cached"] < whole
    assert second["memory_cached"] >= whole
    assert first["store_cached"] >= whole and first["store_restart_cached"] >= whole
    assert all(row[f"{name}_ttft_s"] > 0 for row in data["rows"] for name in ("cold", "memory", "store"))


def test_quantize_benchmark_reports_memory_speed_and_agreement_per_setting(bench, tiny_model_dir):
    args = ["--model", str(tiny_model_dir("llama")), "--settings", "none-float32", "int4-bfloat16"]
    sizes = ["--context", "40", "--new-tokens", "3", "--repeats", "1", "--prompts", "2", "--prompt-tokens", "12"]
    out, data = bench("quantize", *args, *sizes, "--agree-tokens", "3", "--window", "48")
    assert "\nmachine: " in out and "top-1 agree" in out
    rows = {row["setting"]: row for row in data["rows"]}
    assert [rows[s]["quantization"] for s in ("none-float32", "int4-bfloat16")] == ["none", "int4"]
    # float32 agrees with itself, and its perplexity is the unit the others are measured in.
    assert rows["none-float32"]["agreement"] == 1.0 and rows["none-float32"]["ppl_over_float32"] == 1.0
    assert rows["none-float32"]["tensor_mb"] > 3 * rows["int4-bfloat16"]["tensor_mb"]
    for row in rows.values():
        assert 0 <= row["agreement"] <= 1 and row["perplexity"] > 1 and row["decode_tok_s"] > 0
        assert row["weights_peak_mb"] >= row["weights_rss_mb"] > 0


def test_shaped_quantized_benchmark_builds_runs_saves_and_restores(bench, tiny_model_dir, tmp_path):
    folder = tmp_path / "shaped"
    args = ["--shape", "tiny", "--folder", str(folder), "--tokenizer-from", str(tiny_model_dir("llama"))]
    lengths = ["--lengths", "40", "100", "--real-tokens", "40"]
    out, data = bench("shaped_quantized", *args, *lengths, "--new-tokens", "3", "--cli-tokens", "0")
    assert "tiny-shaped" in out
    row, longer = data["rows"]
    assert row["tokens"] == 40 and row["quantize"] == "int4" and row["file_mb"] > 0
    assert row["save_gb_s"] > 0 and row["restore_gb_s"] > 0 and row["weights_rss_gb"] > 0
    # Past --real-tokens: filled from the real prefill's KV, not prefilled, and its snapshot restores whole.
    assert longer["tokens"] == 100 and longer["filled_from"] == 40 and longer["prefill_s"] is None
    assert longer["kv_mb"] == 2.5 * row["kv_mb"] and longer["decode_tok_s"] > 0
    # One bfloat16 shard per layer, besides the embedding and the head.
    assert len(list(folder.glob("layer-*.safetensors"))) == 2


def test_quantized_load_benchmark_keeps_the_form_once_and_maps_it_after(bench, tiny_model_dir):
    from kvsnap.models import qkernel

    if qkernel.library() is None:
        pytest.skip(f"forms are kept for kvsnap's kernel, not available here: {qkernel.unavailable_reason()}")
    out, data = bench("quantized_load", "--model", str(tiny_model_dir("llama")), "--repeats", "1", "--tokens", "16")
    rows = {(r["mode"], r["load"]): r for r in data["rows"]}
    assert set(rows) >= {("none", "-"), ("int4-a16", "first"), ("int4-a16", "later"), ("int8-a16", "later")}
    assert not rows["int4-a16", "first"]["mapped"] and rows["int4-a16", "later"]["mapped"]
    assert rows["int8-a16", "later"]["kept_mb"] > 0 and "minus import torch" in out


def test_verify_benchmark(bench, tiny_model_dir):
    args = ("--model", str(tiny_model_dir("llama")), "--lengths", "200", "--block-size", "32", "--repeats", "1")
    out, data = bench("verify", *args)
    (row,) = data["rows"]
    assert "verify_s" in out and row["tokens"] == 216
    # 200 tokens of 32-token blocks: 7 restored; the first, the last and one between, each a block's prefill
    # and two one-token forwards (the last block holds 8 tokens).
    assert row["blocks_checked"] == 3 and row["blocks"][0] == 0 and row["blocks"][-1] == 6
    assert row["check_tokens"] == (32 + 2) * 2 + (8 + 2)
    assert row["verify_s"] > 0 and row["max_abs_diff"] < 1e-4
