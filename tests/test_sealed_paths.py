"""What was encrypted stays encrypted on every path that writes it: a store session exported, a
sealed snapshot imported, a batch job that resumed one, a run that resumed an encrypted store
session. Each is sealed with the source's key, and nothing sealed lands in a plain store."""

from __future__ import annotations

import json

import pytest
from cli_helpers import kvsnap

from kvsnap.format import Snapshot
from kvsnap.format.sealed import is_sealed
from kvsnap.sealing import KEY_ENV, SealKey, write_key_file
from kvsnap.store import BlockStore

SECRET = "Note: the vault code is four seven one one."
BASE = ["--device", "cpu", "--block-size", "4", "--reuse", "load"]


@pytest.fixture
def key(tmp_path, monkeypatch) -> SealKey:
    made = write_key_file(tmp_path / "key")
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "key"))
    return made


@pytest.fixture
def model(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


def run(model: str, *args) -> dict:
    ran = kvsnap("run", "--model", model, *BASE, "--max-new-tokens", "2", "--json", *args)
    assert ran.returncode == 0, ran.stderr
    return json.loads(ran.stdout.splitlines()[-1])


def tokens_of(path) -> list[int]:
    with Snapshot(path) as snap:
        return list(snap.tokens)


def assert_sealed_with(path, key: SealKey, like) -> None:
    """``path`` is sealed with ``key`` and starts with the prompt's tokens as ``like`` holds them."""
    assert is_sealed(path), f"{path} was written in the clear"
    with Snapshot(path) as snap:
        assert snap.key is not None and snap.key.key_id == key.key_id
    assert tokens_of(path)[:8] == tokens_of(like)[:8]


def test_store_export_of_an_encrypted_store_writes_a_sealed_file(tmp_path, key, model):
    store = tmp_path / "enc-store"
    run(model, "--encrypt", "--store", store, "--store-session", "talk", "--prompt", SECRET)
    made = kvsnap("store", "export", store, "talk", tmp_path / "out.kv")
    assert made.returncode == 0, made.stderr
    run(model, "--encrypt", "--prompt", SECRET, "--save", tmp_path / "ref.kv")
    assert_sealed_with(tmp_path / "out.kv", key, tmp_path / "ref.kv")


def test_store_import_of_a_sealed_file_is_refused_by_a_plain_store_and_seals_a_new_one(tmp_path, key, model):
    enc = tmp_path / "enc.kv"
    run(model, "--encrypt", "--prompt", SECRET, "--save", enc)
    plain = tmp_path / "plain-store"
    BlockStore(plain)
    refused = kvsnap("store", "import", plain, enc)
    assert refused.returncode == 1 and "encrypted" in refused.stderr and "plain block store" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    assert BlockStore(plain).sessions() == []
    # A new store made by the import is an encrypted one, with the file's key.
    made = kvsnap("store", "import", tmp_path / "new-store", enc)
    assert made.returncode == 0, made.stderr
    new = BlockStore(tmp_path / "new-store")
    assert new.key is not None and new.key.key_id == key.key_id
    assert [s.name for s in new.sessions()] == ["enc"]


def test_a_batch_job_that_resumed_a_sealed_file_saves_sealed_and_keeps_it_out_of_a_plain_store(tmp_path, key, model):
    enc = tmp_path / "enc.kv"
    run(model, "--encrypt", "--prompt", SECRET, "--save", enc)
    jobs = tmp_path / "jobs.jsonl"
    job = {"id": 1, "prompt": SECRET + " More.", "resume": str(enc), "save": str(tmp_path / "out.kv")}
    jobs.write_text(json.dumps(job) + "\n")
    plain = tmp_path / "plain-store"
    BlockStore(plain)
    ran = kvsnap("run", "--model", model, *BASE, "--max-new-tokens", "2", "--batch", jobs, "--store", plain)
    assert ran.returncode == 0, ran.stderr
    row = json.loads(ran.stdout.splitlines()[-1])
    assert row["hit_tokens"] > 0 and "saved" in row
    assert_sealed_with(tmp_path / "out.kv", key, enc)
    assert "encrypted" in row["store_error"]
    assert BlockStore(plain).read_index().blocks == {}


def test_a_run_on_an_encrypted_store_session_saves_sealed_without_encrypt(tmp_path, key, model):
    store = tmp_path / "enc-store"
    run(model, "--encrypt", "--store", store, "--store-session", "talk", "--prompt", SECRET)
    row = run(model, "--store", store, "--store-session", "talk", "--prompt", SECRET, "--save", tmp_path / "x.kv")
    assert row["hit_tokens"] > 0
    run(model, "--encrypt", "--prompt", SECRET, "--save", tmp_path / "ref.kv")
    assert_sealed_with(tmp_path / "x.kv", key, tmp_path / "ref.kv")
