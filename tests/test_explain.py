"""Explaining a miss: each cause is built on purpose, and the explanation must name it.

The library (``kvsnap.engine.explain``, ``Session`` with ``explain=True``), ``kvsnap inspect --prompt``,
``kvsnap run/chat --explain`` and ``kvsnap store explain``, on the tiny random-weight Llama.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import kvsnap
from tiny_models import perturbed_copy
from typer.testing import CliRunner

from kvsnap.config import SamplingParams
from kvsnap.engine import explain
from kvsnap.engine.session import Session
from kvsnap.models import load_model
from kvsnap.models.locate import LightTokenizer
from kvsnap.store import BlockStore
from kvsnap_cli.main import app

ROOT = Path(__file__).resolve().parents[1]
BS = 8
PRIME = SamplingParams(max_new_tokens=0)
DOC = "Once upon a time there was a small cache that kept every key and value it had ever seen. "
USER = {"role": "user", "content": "What is the capital of France?"}
ANSWER = "The capital of France is Paris."
runner = CliRunner()


def ids_of(lm, text: str) -> list[int]:
    return list(lm.tokenizer(text, add_special_tokens=False)["input_ids"])


def save(lm, tokens: list[int], path: Path, messages=None, **settings) -> Path:
    s = Session(lm, block_size=BS, **settings)
    s.prefill(tokens)
    s.messages = messages
    s.save(path)
    return path


def explained(lm, prompt: list[int], resume: Path | None = None, messages=None, **settings) -> dict:
    s = Session(lm, block_size=settings.pop("block_size", BS), explain=True, on_mismatch="recompute", **settings)
    result = s.run(prompt, PRIME, resume=resume, prompt_messages=messages)
    assert result.miss is not None
    return result.miss


def test_a_snapshot_ending_mid_word_is_a_tokenization_shift(llama, tmp_path):
    head, full = DOC + "The quick brown fox jumps ov", DOC + "The quick brown fox jumps over the lazy dog."
    assert ids_of(llama, full)[: len(ids_of(llama, head))] != ids_of(llama, head)  # 'ov' + 'er' merge differently
    snap = save(llama, ids_of(llama, head), tmp_path / "head.kv")
    miss = explained(llama, ids_of(llama, full), snap)
    assert miss["cause"] == "tokenization" and "same text" in miss["why"]
    assert miss["position"] < len(ids_of(llama, head)) and miss["block"] == miss["position"] // BS
    assert miss["reused_tokens"] == miss["position"]
    assert miss["before"] + miss["prompt_after"] in full and miss["source_after"] in full


def test_changed_text_is_named_with_both_sides(llama, tmp_path):
    snap = save(
        llama, ids_of(llama, DOC + "What is the capital of France? The capital of France is Paris."), tmp_path / "a.kv"
    )
    miss = explained(llama, ids_of(llama, DOC + "What is the capital of Italy? The capital of Italy is Rome."), snap)
    assert miss["cause"] == "text" and miss["source"] == "snapshot"
    assert miss["before"].endswith("capital of")
    assert miss["source_after"].startswith(" France") and miss["prompt_after"].startswith(" Italy")
    assert miss["source_next"] and miss["prompt_next"]


def test_nothing_missed_when_the_prompt_continues_the_snapshot(llama, tmp_path):
    snap = save(llama, ids_of(llama, DOC), tmp_path / "doc.kv")
    miss = explained(llama, ids_of(llama, DOC) + ids_of(llama, "And of Italy?"), snap)
    assert miss["cause"] == "none" and miss["position"] is None and "continues all" in miss["why"]


@pytest.mark.parametrize("with_messages", [False, True])
def test_a_changed_system_message_is_named(llama, tmp_path, with_messages):
    old = [{"role": "system", "content": "You are a helpful assistant."}, USER]
    new = [{"role": "system", "content": "You are a pirate."}, USER]
    s = Session(llama, block_size=BS)
    snap = save(llama, s.render_chat(old), tmp_path / "sys.kv", messages=old if with_messages else None)
    miss = explained(llama, s.render_chat(new), snap, messages=new)
    assert miss["cause"] == "system" and miss["message"] == 0
    assert "system message changed" in miss["why"]


def test_an_added_system_message_is_named(llama, tmp_path):
    s = Session(llama, block_size=BS)
    snap = save(llama, s.render_chat([USER]), tmp_path / "u.kv", messages=[USER])
    new = [{"role": "system", "content": "Answer briefly."}, USER]
    assert explained(llama, s.render_chat(new), snap, messages=new)["why"] == "the system message was added"


def _answer_tokenized_apart(lm, tmp_path: Path) -> tuple[Path, list[dict[str, str]]]:
    """A chat snapshot whose answer is held as other tokens than its text encodes to (as sampled answers
    often are): one token per character."""
    s = Session(lm, block_size=BS)
    answer_ids = [t for ch in ANSWER for t in ids_of(lm, ch)]
    assert answer_ids != ids_of(lm, ANSWER)
    held = s.render_chat([USER]) + answer_ids + ids_of(lm, "<|im_end|>\n")
    messages = [USER, {"role": "assistant", "content": ANSWER}]
    return save(lm, held, tmp_path / "chat.kv", messages=messages), messages


def test_an_answer_that_renders_to_other_tokens_is_the_chat_template(llama, tmp_path):
    snap, messages = _answer_tokenized_apart(llama, tmp_path)
    follow = [*messages, {"role": "user", "content": "And of Italy?"}]
    miss = explained(llama, Session(llama).render_chat(follow), snap, messages=follow)
    assert miss["cause"] == "template" and miss["message"] == 1
    assert "earlier answer" in miss["why"] and "same text, different tokens" in miss["why"]


def test_a_chat_turn_explains_what_it_did_not_reuse_of_the_conversation(llama, tmp_path):
    snap, _ = _answer_tokenized_apart(llama, tmp_path)
    s = Session(llama, block_size=BS, explain=True)
    held = s.restore(snap).hit_tokens
    result = s.chat("And of Italy?", SamplingParams(max_new_tokens=2, temperature=0))
    assert result.hit_tokens < held
    assert result.miss["source"] == "session" and result.miss["cause"] == "template"


def test_same_messages_rendered_to_other_text_is_the_chat_template(tiny_model_dir):
    """A template that renders an earlier answer with its reasoning, then without it (as some do)."""
    tok = LightTokenizer(tiny_model_dir("llama"))
    messages = [USER, {"role": "assistant", "content": ANSWER}]
    head = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    source = tok.encode(head + "<think>hmm</think>" + ANSWER + "<|im_end|>\n")
    follow = [*messages, {"role": "user", "content": "And of Italy?"}]
    prompt = tok.encode(head + ANSWER + "<|im_end|>\n<|im_start|>user\nAnd of Italy?<|im_end|>\n")
    miss = explain.explain(
        prompt, source, tok.decode, block_size=BS, reused=0, prompt_messages=follow, source_messages=messages
    )
    assert miss.cause == "template" and "same messages, different text" in miss.why


def test_another_models_weights_are_named(llama, tiny_model_dir, tmp_path):
    snap = save(llama, ids_of(llama, DOC), tmp_path / "doc.kv")
    other = load_model(str(perturbed_copy(tiny_model_dir("llama"), tmp_path / "tuned")), device="cpu")
    miss = explained(other, ids_of(llama, DOC + "more"), snap)
    assert miss["cause"] == "model" and miss["differs"] == ["weights"] and miss["reused_tokens"] == 0
    assert "different weights" in miss["why"]


def test_another_kv_dtype_is_named(llama, tiny_lm, tmp_path):
    snap = save(llama, ids_of(llama, DOC), tmp_path / "doc.kv")
    miss = explained(tiny_lm("llama", "bfloat16"), ids_of(llama, DOC), snap)
    assert miss["cause"] == "model" and miss["differs"] == ["kv_dtype"]
    assert "different KV dtype: float32, not bfloat16" in miss["why"]


def test_another_namespace_is_named(llama, tmp_path):
    alice = save(llama, ids_of(llama, DOC), tmp_path / "alice.kv", namespace="alice")
    plain = save(llama, ids_of(llama, DOC), tmp_path / "plain.kv")
    miss = explained(llama, ids_of(llama, DOC), alice, namespace="bob")
    assert miss["cause"] == "namespace" and "another namespace" in miss["why"]
    assert "without a namespace" in explained(llama, ids_of(llama, DOC), plain, namespace="bob")["why"]


def _store_with(llama, tmp_path: Path, *texts: str) -> BlockStore:
    store = BlockStore(tmp_path / "store")
    for text in texts:
        Session(llama, block_size=BS, store=store).run(ids_of(llama, text), PRIME)
    return store


def test_another_block_size_in_the_store_is_named(llama, tmp_path):
    store = _store_with(llama, tmp_path, DOC * 2)
    miss = explained(llama, ids_of(llama, DOC * 2 + "more"), store=store, block_size=16)
    assert miss["cause"] == "block_size" and miss["source"] == "store"
    assert "block size 8; this run uses 16" in miss["why"]


def test_store_explain_names_the_closest_prefix_and_where_it_diverged(llama, tiny_model_dir, tmp_path):
    store = _store_with(
        llama, tmp_path, DOC + "The quick brown fox jumps over the lazy dog.", DOC + "Blocks of tokens."
    )
    model = str(tiny_model_dir("llama"))
    prompt = DOC + "The quick brown cat sleeps."
    base = ["store", "explain", str(store.path), "--model", model, "--prompt", prompt]
    result = runner.invoke(app, [*base, "--block-size", str(BS), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    miss = info["miss"]
    assert miss["cause"] == "text" and miss["source"] == "store"
    assert miss["source_after"].startswith(" fox") and miss["prompt_after"].startswith(" cat")
    assert miss["reused_tokens"] == info["matched_blocks"] * BS == miss["block"] * BS
    assert info["made_by"] and info["made_by"][0]["transformers"]
    text = runner.invoke(app, [*base, "--block-size", str(BS)])
    assert "closest stored prefix" in text.stdout and "reuse stopped at token" in text.stdout
    other = json.loads(runner.invoke(app, [*base, "--block-size", "16", "--json"]).stdout)["miss"]
    assert other["cause"] == "block_size"
    bob = json.loads(runner.invoke(app, [*base, "--block-size", str(BS), "--namespace", "bob", "--json"]).stdout)
    assert bob["miss"]["cause"] == "namespace" and bob["miss"]["reused_tokens"] == 0


def test_inspect_prompt_explains_the_miss_without_torch(llama, tmp_path, kvsnap_home):
    snap = save(llama, ids_of(llama, DOC + "The capital of France is Paris."), tmp_path / "a.kv")
    prompt = DOC + "The capital of Italy is Rome."
    code = (
        "import sys; from kvsnap_cli.main import app\n"
        f"try:\n    app(['inspect', {str(snap)!r}, '--json', '--prompt', {prompt!r}])\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=os.environ)
    assert proc.returncode == 0, proc.stderr
    miss = json.loads(proc.stdout)["miss"]
    assert miss["cause"] == "text" and miss["prompt_after"].startswith(" Italy")
    shown = runner.invoke(app, ["inspect", str(snap), "--prompt", prompt])
    assert "reuse stopped at token" in shown.stdout and "» France" in shown.stdout and "» Italy" in shown.stdout


def test_inspect_with_a_model_names_the_differing_fingerprint_part(llama, tiny_model_dir, tmp_path):
    snap = save(llama, ids_of(llama, DOC), tmp_path / "doc.kv")
    tuned = perturbed_copy(tiny_model_dir("llama"), tmp_path / "tuned")
    result = runner.invoke(app, ["inspect", str(snap), "--json", "--prompt", DOC, "--model", str(tuned)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["miss"]["differs"] == ["weights"]
    same = runner.invoke(
        app, ["inspect", str(snap), "--json", "--prompt", DOC, "--model", str(tiny_model_dir("llama"))]
    )
    assert json.loads(same.stdout)["miss"]["cause"] == "none"


def test_run_explain_puts_the_miss_in_the_ledger(llama, tiny_model_dir, tmp_path):
    snap = save(llama, ids_of(llama, DOC + "The capital of France is Paris."), tmp_path / "a.kv")
    args = ["run", "--model", str(tiny_model_dir("llama")), "--device", "cpu", "--block-size", str(BS)]
    args += ["--prompt", DOC + "The capital of Italy is Rome.", "--resume", str(snap), "--max-new-tokens", "0"]
    row = json.loads(runner.invoke(app, [*args, "--explain", "--json"]).stdout)
    assert row["miss"]["cause"] == "text" and row["miss"]["reused_tokens"] == row["hit_tokens"]
    assert json.loads(runner.invoke(app, [*args, "--json"]).stdout)["miss"] is None  # only when asked
    shown = runner.invoke(app, [*args, "--explain"])
    assert "reuse stopped at token" in shown.stderr and "the prompt's text differs" in shown.stderr


def test_chat_explain_notes_a_turn_that_reused_less_than_it_held(llama, tiny_model_dir, tmp_path):
    snap, _ = _answer_tokenized_apart(llama, tmp_path)
    args = ["chat", "--model", str(tiny_model_dir("llama")), "--device", "cpu", "--block-size", str(BS)]
    args += ["--resume", str(snap), "--temperature", "0", "--max-new-tokens", "2", "--explain"]
    proc = kvsnap(*args, input="And of Italy?\n")
    assert proc.returncode == 0, proc.stderr
    assert "reuse stopped at token" in proc.stderr and "renders an earlier answer again" in proc.stderr


def test_a_prefix_stored_under_several_namespaces_is_explained_for_the_runs_own(llama, tmp_path):
    store = BlockStore(tmp_path / "store")
    for namespace in ("alice", "bob", "carol"):
        Session(llama, block_size=BS, store=store, namespace=namespace).run(ids_of(llama, DOC * 2), PRIME)
    prompt = ids_of(llama, DOC * 2 + "more")
    for namespace in ("alice", "bob", "carol"):
        assert explained(llama, prompt, store=store, namespace=namespace)["cause"] == "none"
    assert explained(llama, prompt, store=store, namespace="dave")["cause"] == "namespace"


def test_a_chain_a_serving_engine_made_names_the_engine():
    """vLLM's blocks (kvsnap/integrations/vllm.py) key chains of their own: the miss says who made them."""
    parts = {"config": "c", "tokenizer": "t", "weights": "w"}
    made = {**parts, "kv_dtype": "float32", "engine": "vllm 0.32.0 CPU_ATTN/vec"}
    cause, why, differs = explain.chain_mismatch(
        explain.Running(parts, "", 128, "m"),
        model="m",
        fingerprint="0" * 32,
        parts=made,
        kv_dtype="float32",
        root=b"r",
        block_size=128,
        check_block_size=True,
    )
    assert cause == "model" and differs == ()
    assert why == "made with another model (different engine: computed by vllm 0.32.0 CPU_ATTN/vec)"
