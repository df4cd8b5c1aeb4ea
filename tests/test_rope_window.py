"""RoPE whose frequencies depend on the sequence length (Phi-3 longrope, dynamic NTK): kvsnap runs such a model
only within the window where its frequencies are fixed, and there it is exact.

transformers picks a forward's frequencies from its longest position, so past the window the KV of a token
depends on how the sequence was cut into forwards: a chunked prefill, a decode step or a resume would each
compute other KV than one forward over the whole sequence. The tiny models switch at 64 tokens
(tiny_models.SWITCHING_ROPE).
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from tiny_models import CORPUS, SWITCHING_ROPE
from typer.testing import CliRunner

from kvsnap import limits
from kvsnap.engine.sampling import SamplingParams
from kvsnap.engine.session import Session
from kvsnap.errors import ConfigError, ForeignSnapshotError
from kvsnap.models import load_model
from kvsnap.models.architecture import forward_cache_kwarg, rope_window
from kvsnap.models.load import max_positions_of
from kvsnap_cli.main import app

WINDOW = 64
ARCHS = list(SWITCHING_ROPE)
BS = 8
ATOL = 1e-4
# Greedy to the end of the window: no loop detection, which would end a random model's answer early.
TO_THE_END = SamplingParams(temperature=0, max_new_tokens=500, stop_loops=False)
runner = CliRunner()


def ids_of(lm, n: int) -> list[int]:
    ids = list(lm.tokenizer("".join(CORPUS), add_special_tokens=False)["input_ids"])
    assert len(ids) >= n
    return ids[:n]


def cli(*args: str):
    return runner.invoke(app, list(args))


def error_line(result) -> str:
    """The one line a refusal prints (a "loading ..." status may come before it)."""
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    return line


def base(folder) -> list[str]:
    return ["--model", str(folder), "--device", "cpu", "--block-size", str(BS), "--chunk-size", "32"]


@pytest.fixture(scope="module")
def reference():
    """``reference(folder)``: the folder's model as transformers loads it, run by its own ``model(ids)``."""
    from transformers import AutoModelForCausalLM

    models = {}

    def get(folder):
        if folder not in models:
            models[folder] = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        return models[folder]

    return get


def reference_greedy(model, prompt: list[int], window: int) -> tuple[torch.Tensor, list[int]]:
    """The prompt's last logits and the greedy tokens up to the window, each from one forward over the
    whole sequence (no cache): what every cut of the sequence into forwards must reproduce."""
    ids = list(prompt)
    first = None
    with torch.inference_mode():
        while len(ids) < window:
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            first = logits if first is None else first
            ids.append(int(logits.argmax()))
    return first, ids[len(prompt) :]


def cold(lm, prompt: list[int], chunk_size: int):
    s = Session(lm, block_size=BS, chunk_size=chunk_size)
    s.prefill(prompt)
    logits = s.last_logits.clone()
    return logits, s.generate(TO_THE_END)


# -- where the window is ---------------------------------------------------------------------------


def test_rope_window_reads_every_form_of_the_config():
    from transformers import LlamaConfig, Phi3Config

    factors = {"short_factor": [1.0] * 48, "long_factor": [2.0] * 48}  # Phi-3.5-mini: head dim 96
    phi35 = Phi3Config(
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rope_scaling={"type": "longrope", **factors},
    )
    assert rope_window(phi35) == max_positions_of(phi35) == 4096
    legacy = SimpleNamespace(max_position_embeddings=131072, rope_scaling={"type": "su", **factors})
    assert rope_window(legacy) == 131072  # no original length stated: transformers takes the model's
    inside = SimpleNamespace(
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "longrope", "original_max_position_embeddings": 8192, **factors},
    )
    assert rope_window(inside) == max_positions_of(inside) == 8192
    for key in ("type", "rope_type"):
        dynamic = LlamaConfig(max_position_embeddings=4096, rope_scaling={key: "dynamic", "factor": 4.0})
        assert rope_window(dynamic) == max_positions_of(dynamic) == 4096  # not stretched to 16,384
    per_layer = SimpleNamespace(
        max_position_embeddings=2048,
        rope_parameters={"full_attention": {"rope_type": "dynamic", "factor": 2.0}, "sliding_attention": None},
    )
    assert rope_window(per_layer) == 2048
    for rope in (
        None,
        {"rope_type": "default"},
        {"type": "linear", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0},
    ):
        assert rope_window(LlamaConfig(max_position_embeddings=4096, rope_scaling=rope)) is None


@pytest.mark.parametrize("arch", ARCHS)
def test_the_context_is_the_window(arch, tiny_lm):
    lm = tiny_lm(arch)
    assert (lm.max_positions, lm.context_source) == (WINDOW, limits.ROPE_CONTEXT)
    assert load_model(str(lm.folder), device="cpu", ctx_size=WINDOW - 8).max_positions == WINDOW - 8
    with pytest.raises(ConfigError, match=f"RoPE switches frequencies past {WINDOW} tokens"):
        load_model(str(lm.folder), device="cpu", ctx_size=WINDOW + 1)


@pytest.mark.parametrize("arch", ARCHS)
def test_cli_refuses_a_prompt_or_a_context_past_the_window_in_one_line(arch, tiny_model_dir):
    folder = tiny_model_dir(arch)
    long = error_line(cli("run", *base(folder), "--prompt", "".join(CORPUS)))
    assert long.endswith(f"more than the model's context at fixed RoPE frequencies ({WINDOW})")
    wide = error_line(cli("run", *base(folder), "--ctx-size", str(WINDOW + 1), "--prompt", "hi"))
    kind = "longrope" if "longrope" in arch else "dynamic"
    assert f"the model's {kind} RoPE switches frequencies past {WINDOW} tokens" in wide
    assert wide.endswith(f"(--ctx-size {WINDOW} or less)")


def test_ctx_size_past_the_window_is_refused_before_the_weights_load(tmp_path):
    """A Phi-3.5-style 128k longrope config alone (no weights): the refusal comes first, in RoPE's words."""
    from transformers import Phi3Config

    Phi3Config(
        vocab_size=320,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rope_scaling={"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48},
    ).save_pretrained(tmp_path)
    line = error_line(cli("run", "--model", str(tmp_path), "--device", "cpu", "--ctx-size", "8192", "--prompt", "hi"))
    assert "switches frequencies past 4,096 tokens" in line and line.endswith("(--ctx-size 4096 or less)")
    import kvsnap

    with pytest.raises(ConfigError, match="switches frequencies past 4,096 tokens"):
        kvsnap.open_session(str(tmp_path), device="cpu", ctx_size=131072)


# -- within the window: exact ----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_within_the_window_every_cut_computes_what_one_forward_does(arch, tiny_lm, reference):
    lm = tiny_lm(arch)
    prompt = ids_of(lm, WINDOW - 10)
    ref_logits, ref_tokens = reference_greedy(reference(lm.folder), prompt, WINDOW)
    for chunk_size in (512, 32, 1):
        logits, gen = cold(lm, prompt, chunk_size)
        assert torch.allclose(logits, ref_logits, atol=ATOL, rtol=0), (chunk_size, (logits - ref_logits).abs().max())
        assert list(gen.token_ids) == ref_tokens, chunk_size
        assert gen.stop_reason == "context"


@pytest.mark.parametrize("arch", ARCHS)
def test_resumed_equals_cold_within_the_window(arch, tiny_lm, reference, forward_counter, tmp_path):
    lm = tiny_lm(arch)
    prompt = ids_of(lm, WINDOW - 8)
    prefix = prompt[:40]
    _, ref_tokens = reference_greedy(reference(lm.folder), prompt, WINDOW)
    saver = Session(lm, block_size=BS)
    saver.prefill(prefix)
    saver.save(tmp_path / "p.kv")

    s = Session(lm, block_size=BS, chunk_size=32)
    counter = forward_counter(lm)
    result = s.run(prompt, TO_THE_END, resume=tmp_path / "p.kv")
    assert result.hit_tokens == len(prefix)
    assert result.prefill_tokens == len(prompt) - len(prefix)
    # The forward saw the suffix, then one token per decode step but the last (sampled, never run).
    assert counter.tokens == len(prompt) - len(prefix) + len(ref_tokens) - 1
    assert list(s.tokens + s.pending)[len(prompt) :] == ref_tokens
    assert result.stop_reason == "context" and result.new_tokens == WINDOW - len(prompt)


@pytest.mark.parametrize("arch", ARCHS)
def test_cli_generation_stops_at_the_window_and_resumes_verified(arch, tiny_model_dir, tmp_path):
    folder = tiny_model_dir(arch)
    snap = tmp_path / "s.kv"
    args = ["run", *base(folder), "--temperature", "0", "--json"]
    primed = cli(*args, "--prompt", CORPUS[1], "--max-new-tokens", "0", "--save", str(snap))
    assert primed.exit_code == 0, primed.output
    args += ["--max-new-tokens", "500"]
    prompt = CORPUS[1] + CORPUS[0]
    cold_row = json.loads(cli(*args, "--prompt", prompt).stdout)
    assert cold_row["stop_reason"] == "context", cold_row
    assert cold_row["prompt_tokens"] + cold_row["new_tokens"] == WINDOW
    warm = cli(*args, "--prompt", prompt, "--resume", str(snap), "--verify")
    assert warm.exit_code == 0, warm.output
    row = json.loads(warm.stdout)
    assert row["hit_tokens"] > 0 and row["prefill_tokens"] == row["prompt_tokens"] - row["hit_tokens"]
    assert row["verify"]["passed"] and row.get("restore_error") is None
    assert (row["text"], row["stop_reason"]) == (cold_row["text"], "context")


# -- the fingerprint ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "change"),
    [("phi3-longrope", {"long_factor": [1.0] * 8}), ("llama-dynamic", {"factor": 2.0})],
)
def test_a_snapshot_from_other_rope_settings_is_refused(arch, change, tiny_lm, tmp_path):
    """Same weights and tokenizer, other RoPE parameters: another fingerprint, and the snapshot is foreign."""
    lm = tiny_lm(arch)
    other = shutil.copytree(lm.folder, tmp_path / "other")
    cfg = json.loads((other / "config.json").read_text())
    cfg["rope_parameters"].update(change)
    (other / "config.json").write_text(json.dumps(cfg))
    lm2 = load_model(str(other), device="cpu")
    assert lm2.fingerprint != lm.fingerprint
    assert {k for k in lm.fingerprint_parts if lm.fingerprint_parts[k] != lm2.fingerprint_parts[k]} == {"config"}
    s = Session(lm, block_size=BS)
    s.prefill(ids_of(lm, 24))
    s.save(tmp_path / "p.kv")
    with pytest.raises(ForeignSnapshotError):
        Session(lm2, block_size=BS).restore(tmp_path / "p.kv", ids_of(lm, 30))


@pytest.mark.parametrize("arch", ARCHS)
def test_the_tiny_models_switch_at_the_window(arch, tiny_model_dir):
    """Negative control: past the window, the same tokens in two forwards and in one differ.

    A fresh model, cut first: dynamic NTK keeps the frequencies of its longest forward so far.
    """
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir(arch)), dtype=torch.float32).eval()
    kwarg = forward_cache_kwarg(model)
    ids = torch.arange(5, 5 + WINDOW + 16).unsqueeze(0)
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(ids[:, :WINDOW], **{kwarg: cache})
        cut = model(ids[:, WINDOW:], **{kwarg: cache}).logits[0, -1]
        whole = model(ids).logits[0, -1]
    assert (whole - cut).abs().max() > 100 * ATOL
