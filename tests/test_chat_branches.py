"""A chat appends to the token ids it ran, and branches: /fork, /history, /undo, store sessions side by side.

Sampled answers on a tiny random-weight model tokenize otherwise when the template renders them again,
so these chats are the case where re-rendering the history loses reuse: each turn must reuse every
token it computed, and a resumed or forked conversation must continue exactly as the one kept in memory.
"""

from __future__ import annotations

import json
import re

import pytest
from cli_helpers import kvsnap

from kvsnap.config import SamplingParams

SAMPLED = SamplingParams(temperature=1.5, max_new_tokens=12, seed=3)
GREEDY = SamplingParams(temperature=0, max_new_tokens=8)


def session(lm, **settings):
    from kvsnap.engine.session import Session

    return Session(lm, block_size=16, **settings)


def cold_answer(lm, prompt_ids: list[int]) -> str:
    """The greedy answer to ``prompt_ids`` computed from nothing."""
    return session(lm).run(prompt_ids, GREEDY).text


def test_each_turn_reuses_every_token_the_chat_computed_although_rendering_again_differs(llama, forward_counter):
    """Guards the reuse lost at the first re-tokenized answer: a chat re-rendered its history and matched
    it against its tokens, and a sampled answer that tokenizes otherwise as text ended reuse there."""
    s = session(llama, explain=True)
    counter = forward_counter(llama)
    differed = 0
    before: list[int] = []
    for i in range(5):
        computed, held = len(s.tokens), s.num_tokens
        counter.reset()
        r = s.chat(f"message {i} about things", SAMPLED, system="be brief")
        assert r.hit_tokens == computed  # every token with KV is reused
        assert r.prefill_tokens == r.prompt_tokens - computed
        # The forward saw the new part of the prompt and the answer's steps, nothing of the prefix.
        assert counter.tokens == r.prefill_tokens + max(0, r.new_tokens - 1)
        assert s.all_tokens[:held] == before[:held]  # the ids run before are kept as they were
        before = s.all_tokens
        rendered = s.render_chat(s.messages[:-1])
        # explain names the difference exactly when rendering the view again would not give these ids
        assert (r.rerender is not None) == (rendered != s.all_tokens[: r.prompt_tokens])
        if r.rerender is not None:
            differed += 1
            assert r.rerender["cause"] == "template" and r.rerender["position"] < computed
    assert differed  # the case this guards happened in this chat


def test_a_resumed_chat_continues_as_the_one_in_memory_and_as_a_recompute(llama, tmp_path):
    s = session(llama)
    for i in range(3):
        s.chat(f"message {i}", SAMPLED, system="be brief")
    s.save(tmp_path / "c.kv", flush=False)  # as the autosave does: the last sampled token has no KV yet
    resumed = session(llama)
    resumed.restore(tmp_path / "c.kv")
    assert resumed.all_tokens == s.all_tokens and resumed.turn_ends == s.turn_ends
    a, b = s.chat("next", GREEDY), resumed.chat("next", GREEDY)
    assert resumed.all_tokens == s.all_tokens and a.text == b.text
    assert b.text == cold_answer(llama, s.all_tokens[: b.prompt_tokens])


@pytest.mark.parametrize(
    "extra",
    [
        {"turn_ends": [[3, 40], [3, 50]], "pending_ids": [2]},  # not increasing
        {"turn_ends": [[3, 40], [5, 10_000]]},  # past the tokens held
        {"turn_ends": [[3, True]]},
        {"turn_ends": "3:40"},
        {"turn_ends": [[3, 40]], "pending_ids": [-1]},
        {"turn_ends": [[3, 40]], "pending_ids": [10**9]},  # no such token
    ],
)
def test_turn_ends_that_do_not_fit_the_file_are_ignored_and_the_chat_renders_again(llama, tmp_path, extra):
    import dataclasses

    from kvsnap.engine import snapshot_save

    s = session(llama)
    s.chat("first", SAMPLED, system="be brief")
    s.save(tmp_path / "c.kv")
    good = session(llama)
    good.restore(tmp_path / "c.kv")
    assert good.turn_ends == s.turn_ends
    snapshot_save.save(dataclasses.replace(s.contents(), marks=extra), tmp_path / "bad.kv", flushed=0)
    resumed = session(llama)
    resumed.restore(tmp_path / "bad.kv")
    assert resumed.turn_ends == [] and resumed.pending == []
    r = resumed.chat("second", GREEDY)  # rendered again: the chat goes on
    assert r.hit_tokens > 0 and r.text == cold_answer(llama, resumed.all_tokens[: r.prompt_tokens])


def test_undo_keeps_the_kv_of_the_turn_before_without_running_the_model(llama, forward_counter):
    from kvsnap.engine.chat import undo

    s = session(llama)
    s.chat("first", SAMPLED, system="be brief")
    s.chat("second", SAMPLED)
    first_end = s.turn_ends[0][1]
    counter = forward_counter(llama)
    assert undo(s)
    assert counter.tokens == 0
    assert [m["content"] for m in s.messages if m["role"] == "user"] == ["first"] and s.num_tokens == first_end
    r = s.chat("third", GREEDY)
    assert r.hit_tokens == first_end and counter.tokens == r.prefill_tokens + max(0, r.new_tokens - 1)
    assert r.text == cold_answer(llama, s.all_tokens[: r.prompt_tokens])
    assert undo(s) and undo(s) and s.messages == [{"role": "system", "content": "be brief"}]
    assert not undo(s)


def test_two_branches_in_one_store_resumed_alternately_answer_each_from_its_own_state(llama, tmp_path):
    """Guards a branch answered from its sibling's state: both branches share their first blocks in the
    store, and each turn looks the prompt up there."""
    from kvsnap.store import BlockStore

    store = BlockStore(tmp_path / "store")
    s = session(llama, store=store)
    s.chat("a shared start of the conversation", SAMPLED, system="be brief", store_session="main")
    s.store_session("side")
    for turn in range(2):
        for name in ("main", "side"):
            branch = session(llama, store=store)
            branch.restore_store_session(name)
            held = len(branch.tokens)
            r = branch.chat(f"{name} turn {turn}", GREEDY, store_session=name)
            assert r.hit_tokens == held
            assert r.text == cold_answer(llama, branch.all_tokens[: r.prompt_tokens])
    users = {
        name: [m["content"] for m in rec.messages if m["role"] == "user"]
        for name, rec in ((x.name, x) for x in store.sessions())
    }
    start = "a shared start of the conversation"
    assert users == {"main": [start, "main turn 0", "main turn 1"], "side": [start, "side turn 0", "side turn 1"]}


# -- the chat command ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


def chat(model: str, lines: str, *args: str):
    base = ["--model", model, "--device", "cpu", "--block-size", "16", "--max-new-tokens", "8", "--reuse", "load"]
    return kvsnap("chat", *base, "--temperature", "1.5", "--seed", "3", *args, input=lines)


def users(path) -> list[str]:
    ran = kvsnap("inspect", path, "--json")
    assert ran.returncode == 0, ran.stderr
    return [m["content"] for m in json.loads(ran.stdout)["messages"] if m["role"] == "user"]


def forward_seen(stderr: str) -> list[int]:
    return [int(x.replace(",", "")) for x in re.findall(r"forward saw ([\d,]+) tokens", stderr)]


def test_fork_continues_beside_the_file_and_leaves_the_original_as_it_was(model, tmp_path):
    path = tmp_path / "talk.kv"
    ran = chat(model, "one\ntwo\n/fork\nthree\n/history\n", "--resume", str(path))
    assert ran.returncode == 0, ran.stderr
    fork = tmp_path / "talk-2.kv"
    assert f"forked: {path} keeps the conversation so far; this chat goes on in {fork}" in ran.stderr
    assert users(path) == ["one", "two"] and users(fork) == ["one", "two", "three"]
    assert re.search(r"3\. you: three", ran.stderr) and re.search(r"1\. you: one", ran.stderr)
    # Each branch resumes on its own; neither changes the other.
    assert chat(model, "four\n", "--resume", str(path)).returncode == 0
    assert chat(model, "five\n", "--resume", str(fork)).returncode == 0
    assert users(path) == ["one", "two", "four"] and users(fork) == ["one", "two", "three", "five"]
    named = chat(model, "/fork side\nsix\n", "--resume", str(path))
    assert named.returncode == 0, named.stderr
    assert users(tmp_path / "side.kv") == ["one", "two", "four", "six"] and len(users(path)) == 3
    (tmp_path / "link.kv").symlink_to(tmp_path / "elsewhere.kv")  # dangling: a save would create its target
    refused = chat(model, "/fork side\n/fork link\n", "--resume", str(path))
    assert "side.kv exists; pick another name" in refused.stderr
    assert "link.kv exists; pick another name" in refused.stderr and not (tmp_path / "elsewhere.kv").exists()
    assert oct((tmp_path / "talk-2.kv").stat().st_mode & 0o777) == "0o600"


def test_undo_in_the_chat_runs_only_the_next_message(model, tmp_path):
    path = tmp_path / "talk.kv"
    ran = chat(model, "one\ntwo\n/undo\n/stats\nthree\n/stats\n", "--resume", str(path))
    assert ran.returncode == 0, ran.stderr
    kept = int(re.search(r"1 turn left, ([\d,]+) tokens kept", ran.stderr).group(1).replace(",", ""))
    before, after = forward_seen(ran.stderr)
    prompt, reused = (
        int(x.replace(",", "")) for x in re.findall(r"\[([\d,]+) prompt tokens: ([\d,]+) reused", ran.stderr)[-1]
    )
    assert reused == kept  # the last turn reused the KV up to the first exchange
    assert after - before <= prompt - kept + 8  # its new part and the answer's steps only
    assert users(path) == ["one", "three"]


def test_explain_says_where_rendering_again_would_differ(model, tmp_path):
    ran = chat(model, "one\ntwo\nthree\n", "--explain")
    assert ran.returncode == 0, ran.stderr
    assert "kept the " in ran.stderr and "tokens the model saw; rendering again would differ at token" in ran.stderr


def test_store_branches_share_their_first_blocks_in_the_tree(model, tmp_path):
    store = tmp_path / "store"
    args = ("--store", str(store), "--store-session", "main")
    ran = chat(model, "a longer first message so that it fills a few blocks\n/fork\nsecond\n", *args)
    assert ran.returncode == 0, ran.stderr
    assert "this chat goes on as 'main-2'" in ran.stderr
    tree = kvsnap("store", "tree", str(store), "--json")
    assert tree.returncode == 0, tree.stderr
    (root,) = json.loads(tree.stdout)["roots"]
    (shared,) = root["children"]  # one prefix, both sessions below or at it

    def names(node) -> list[str]:
        return [*node["sessions"], *(n for c in node["children"] for n in names(c))]

    assert sorted(names(shared)) == ["main", "main-2"]


def test_a_turn_interrupted_before_its_answer_leaves_the_ids_to_append_to(llama):
    s = session(llama)
    s.chat("first", SAMPLED, system="be brief")
    held, ends = s.all_tokens, list(s.turn_ends)

    def boom(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        s.chat("second", GREEDY, on_progress=boom)
    assert s.all_tokens == held and s.turn_ends == ends
    r = s.chat("second", GREEDY)
    assert r.hit_tokens == len(held) - 1  # all but the answer's last sampled token, run now
    assert r.text == cold_answer(llama, s.all_tokens[: r.prompt_tokens])
