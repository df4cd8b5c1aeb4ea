"""Encrypted snapshots (format version 2): they round-trip with their key, are refused in one line
without it, with another key or with any byte changed, hold nothing of the session in the clear,
and a kvsnap that reads version 1 only refuses them in one line. Key files: 0600, never argv."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from core_helpers import MODEL, assert_one_line, read_everything, write_test_snapshot
from typer.testing import CliRunner

from kvsnap.errors import ConfigError, SnapshotError, SnapshotKeyError, SnapshotVersionError
from kvsnap.format import Snapshot, meta
from kvsnap.format.sealed import clear_facts
from kvsnap.sealing import KEY_ENV, SealKey, read_key_file, write_key_file
from kvsnap_cli.main import app

SECRET = "the vault code is 4711"


@pytest.fixture
def key(tmp_path, monkeypatch) -> SealKey:
    """A key in a 0600 file that $KVSNAP_KEY_FILE names."""
    path = tmp_path / "key"
    made = write_key_file(path)
    monkeypatch.setenv(KEY_ENV, str(path))
    return made


def sealed(path: Path, key: SealKey, **kw):
    logits = np.linspace(-3, 3, 40, dtype=np.float32)
    messages = [{"role": "user", "content": SECRET}]
    return write_test_snapshot(path, last_logits=logits, messages=messages, key=key, **kw)


def test_a_sealed_snapshot_reads_back_as_the_plain_one(tmp_path, key):
    enc = sealed(tmp_path / "enc.kv", key)
    plain = write_test_snapshot(
        tmp_path / "plain.kv",
        last_logits=np.linspace(-3, 3, 40, dtype=np.float32),
        messages=[{"role": "user", "content": SECRET}],
    )
    a, b = read_everything(enc.path), read_everything(plain.path)
    assert (a["tokens"], a["blocks"], a["logits"]) == (b["tokens"], b["blocks"], b["logits"])
    assert a["meta"].messages == b["meta"].messages and a["meta"].model == MODEL
    with Snapshot(enc.path) as snap:
        assert snap.sealing is not None and snap.sealing.key_id == key.key_id and snap.verify() == []
    # Nothing of the session is in the clear: no text, no model, no token ids, no block hashes.
    data = enc.path.read_bytes()
    for clear in (SECRET.encode(), MODEL.encode(), np.asarray(enc.tokens, "<i4").tobytes(), enc.blocks[0].hash):
        assert clear not in data
    assert read_key_file(os.environ[KEY_ENV]).key_id == key.key_id


def test_without_the_key_or_with_another_it_is_one_line(tmp_path, key, monkeypatch):
    enc = sealed(tmp_path / "enc.kv", key)
    other = write_key_file(tmp_path / "other")
    with pytest.raises(SnapshotKeyError) as info:
        Snapshot(enc.path, other)
    assert_one_line(info.value)
    assert f"encrypted with another key (key {key.key_id}" in str(info.value)
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(SnapshotKeyError) as info:
        Snapshot(enc.path)
    assert_one_line(info.value)
    assert KEY_ENV in str(info.value)
    facts = clear_facts(enc.path)  # what anyone may read: nothing of the session
    assert facts["encrypted"] and facts["key_id"] == key.key_id and facts["blocks"] == 3
    assert SECRET not in json.dumps(facts) and MODEL not in json.dumps(facts)


def test_every_byte_changed_in_a_small_sealed_file_is_refused(tmp_path, key):
    enc = sealed(tmp_path / "small.kv", key, num_tokens=5, block_size=4)
    data = enc.path.read_bytes()
    assert len(data) < 4096
    victim = tmp_path / "victim.kv"
    for i in range(len(data)):
        flipped = bytearray(data)
        flipped[i] ^= 0x01 if i % 2 else 0xFF
        victim.write_bytes(bytes(flipped))
        problems = []
        try:
            with Snapshot(victim, key) as snap:
                problems = snap.verify()  # every block and the logits, each refusal a line
                snap.read_raw(range(len(snap.meta.blocks)))
        except SnapshotError as exc:
            problems = [str(exc)]
        assert problems, f"byte {i} changed, and the file still read"
        for line in problems:
            assert "\n" not in line and str(victim) in line, line


def test_a_kvsnap_that_reads_version_1_only_refuses_a_sealed_file_in_one_line(tmp_path, key, monkeypatch):
    enc = sealed(tmp_path / "enc.kv", key)
    monkeypatch.setattr(meta, "READABLE_VERSIONS", (1,))
    with pytest.raises(SnapshotVersionError) as info:
        Snapshot(enc.path)
    assert_one_line(info.value)
    assert "format version 2 is newer than this kvsnap supports (reads 1)" in str(info.value)
    # A plain file is still version 1, for every kvsnap.
    plain = write_test_snapshot(tmp_path / "plain.kv")
    assert read_everything(plain.path)["meta"].format_version == 1


def test_key_files_are_private_and_never_replaced(tmp_path):
    path = tmp_path / "k"
    write_key_file(path)
    assert (path.stat().st_mode & 0o777) == 0o600
    with pytest.raises(ConfigError, match="never overwrites"):
        write_key_file(path)
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        read_key_file(path)
    bad = tmp_path / "bad"
    bad.write_text("not a key\n")
    bad.chmod(0o600)
    with pytest.raises(ConfigError, match="not a kvsnap key file"):
        read_key_file(bad)
    assert "SealKey(key_id=" in repr(write_key_file(tmp_path / "k2"))  # never the key itself


def test_the_cli_encrypts_keeps_it_encrypted_and_inspect_shows_only_the_clear(tiny_model_dir, tmp_path, monkeypatch):
    runner = CliRunner()
    model = str(tiny_model_dir("llama"))
    snap = tmp_path / "chat.kv"
    base = ["--model", model, "--device", "cpu", "--block-size", "4", "--reuse", "load"]
    run = ["run", *base, "--prompt", f"Note: {SECRET}.", "--max-new-tokens", "2", "--save", str(snap)]
    monkeypatch.delenv(KEY_ENV, raising=False)
    refused = runner.invoke(app, [*run, "--encrypt"])
    assert refused.exit_code == 1 and KEY_ENV in refused.output and len(refused.output.strip().splitlines()) == 1
    assert runner.invoke(app, ["keygen", str(tmp_path / "key")]).exit_code == 0
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "key"))
    made = runner.invoke(app, [*run, "--encrypt", "--json"])
    assert made.exit_code == 0, made.output
    assert clear_facts(snap)["encrypted"]
    # A resume of it, saved again without --encrypt, stays encrypted.
    again = runner.invoke(app, [*run[:-2], "--resume", str(snap), "--save", str(snap), "--json"])
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["hit_tokens"] > 0 and clear_facts(snap)["encrypted"]
    shown = json.loads(runner.invoke(app, ["inspect", str(snap), "--json"]).stdout)
    assert shown["encrypted"]["key_id"] and shown["tokens"] > 0
    monkeypatch.delenv(KEY_ENV)
    locked = runner.invoke(app, ["inspect", str(snap), "--json"])
    assert locked.exit_code == 0 and json.loads(locked.stdout)["encrypted"] is True
    assert model not in locked.stdout and "tokens" not in json.loads(locked.stdout)
    verify = runner.invoke(app, ["inspect", str(snap), "--verify"])
    assert verify.exit_code == 1 and KEY_ENV in verify.output
