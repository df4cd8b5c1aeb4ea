"""Encrypted block stores: every file sealed, names keyed; the store works as a plain one with its
key, refuses to open without it or with another in one line, refuses a changed byte, and a kvsnap
that reads plain stores only refuses it at its marker."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_store import make_blocks, make_chain, put
from typer.testing import CliRunner

from kvsnap.errors import StoreError
from kvsnap.sealing import KEY_ENV, write_key_file
from kvsnap.store import BlockStore, folder
from kvsnap_cli.main import app

TOKENS = list(range(200, 216))  # four blocks of four


@pytest.fixture
def key(tmp_path, monkeypatch):
    made = write_key_file(tmp_path / "key")
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "key"))
    return made


def files_of(root):
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_an_encrypted_store_works_as_a_plain_one_and_shows_nothing(tmp_path, key):
    chain = make_chain()
    store = BlockStore(tmp_path / "store", key=key)
    logits = np.linspace(-1, 1, 32, dtype=np.float32)
    put(
        store,
        chain,
        TOKENS,
        name="secret-talk",
        messages=[{"role": "user", "content": "the vault code"}],
        last_logits=logits,
    )
    again = BlockStore(tmp_path / "store")  # the key from $KVSNAP_KEY_FILE
    match, blocks = again.fetch(TOKENS, chain.root, chain.block_size)
    assert match.full_blocks == 4
    assert [b.data for b in blocks] == [b.stored for b in make_blocks(chain, TOKENS)]
    _, session, _, kept_logits = again.read_session("secret-talk")
    assert session.messages == ({"role": "user", "content": "the vault code"},)
    assert kept_logits == logits.tobytes()
    assert again.check() == []
    # No file name is a block hash, and no file holds a hash, a token id run, a name or the text.
    hashes = [b.hash for b in make_blocks(chain, TOKENS)]
    names = " ".join(str(p) for p in files_of(tmp_path / "store"))
    everything = b"".join(p.read_bytes() for p in files_of(tmp_path / "store"))
    for h in hashes:
        assert h.hex() not in names and h not in everything and h.hex().encode() not in everything
    for clear in (b"secret-talk", b"the vault code", np.asarray(TOKENS[:4], "<i4").tobytes(), b'"tokens"'):
        assert clear not in everything
    marker = json.loads((tmp_path / "store" / "kvsnap-store.json").read_text())
    assert marker["version"] == 2 and marker["sealed"]["key_id"] == key.key_id


def test_without_its_key_with_another_or_with_a_key_for_a_plain_store_it_is_one_line(tmp_path, key, monkeypatch):
    BlockStore(tmp_path / "sealed", key=key)
    other = write_key_file(tmp_path / "other")
    with pytest.raises(StoreError, match="encrypted store of another key") as info:
        BlockStore(tmp_path / "sealed", key=other)
    assert "\n" not in str(info.value)
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(StoreError, match=KEY_ENV):
        BlockStore(tmp_path / "sealed")
    BlockStore(tmp_path / "plain")
    with pytest.raises(StoreError, match="not encrypted"):
        BlockStore(tmp_path / "plain", key=key)
    # A kvsnap that reads plain stores only stops at the marker.
    monkeypatch.setattr(folder, "READABLE_VERSIONS", (1,))
    with pytest.raises(StoreError, match="store format version 2 is not one this kvsnap reads"):
        BlockStore(tmp_path / "sealed", key=key)


def test_a_changed_byte_anywhere_is_refused(tmp_path, key):
    chain = make_chain()
    store = BlockStore(tmp_path / "store", key=key)
    put(store, chain, TOKENS[:4])
    (block,) = [p for p in files_of(tmp_path / "store") if p.suffix == ".blk"]
    index = tmp_path / "store" / "index.json"
    original = {p: p.read_bytes() for p in (block, index)}
    for path, data in original.items():
        for i in range(0, len(data), max(1, len(data) // 97)):
            flipped = bytearray(data)
            flipped[i] ^= 0x5A
            path.write_bytes(bytes(flipped))
            if path == index:
                with pytest.raises(StoreError, match="index"):
                    BlockStore(tmp_path / "store").read_index()
            else:
                assert any("fails authentication" in p for p in BlockStore(tmp_path / "store").check())
            path.write_bytes(data)
    assert BlockStore(tmp_path / "store").check() == []


def test_repair_rebuilds_an_encrypted_index_from_its_sealed_blocks(tmp_path, key):
    chain = make_chain()
    store = BlockStore(tmp_path / "store", key=key)
    put(store, chain, TOKENS)
    (tmp_path / "store" / "index.json").unlink()
    report = BlockStore(tmp_path / "store").repair()
    assert report.recovered_blocks == 4 and not report.unproven
    match, _ = BlockStore(tmp_path / "store").fetch(TOKENS, chain.root, chain.block_size)
    assert match.full_blocks == 4


def test_serve_and_run_take_encrypt_and_need_the_key(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    runner = CliRunner()
    served = runner.invoke(app, ["serve", "--encrypt", "--store", str(tmp_path / "s"), "--port", "0"])
    assert served.exit_code == 1 and KEY_ENV in served.output and len(served.output.strip().splitlines()) == 1
    write_key_file(tmp_path / "key")
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "key"))
    model = str(tiny_model_dir("llama"))
    args = ["run", "--model", model, "--device", "cpu", "--block-size", "4", "--store", str(tmp_path / "s")]
    args += ["--prompt", "The vault code is four seven one one.", "--max-new-tokens", "1", "--json", "--reuse", "load"]
    first = runner.invoke(app, [*args, "--encrypt"])
    assert first.exit_code == 0, first.output
    second = runner.invoke(app, args)  # the store is encrypted: its key comes from $KVSNAP_KEY_FILE
    assert second.exit_code == 0, second.output
    assert json.loads(second.stdout)["hit_tokens"] > 0
    assert b"vault" not in b"".join(p.read_bytes() for p in files_of(tmp_path / "s"))


def test_an_index_copied_from_another_store_of_the_same_key_is_refused(tmp_path, key):
    chain = make_chain()
    one, two = BlockStore(tmp_path / "one", key=key), BlockStore(tmp_path / "two", key=key)
    put(one, chain, TOKENS, name="one-talk")
    put(two, chain, TOKENS[:8], name="two-talk")
    (tmp_path / "two" / "index.json").write_bytes((tmp_path / "one" / "index.json").read_bytes())
    with pytest.raises(StoreError, match="fails authentication") as info:
        BlockStore(tmp_path / "two").sessions()
    assert "\n" not in str(info.value)
    assert [s.name for s in BlockStore(tmp_path / "one").sessions()] == ["one-talk"]


def test_an_encrypted_store_made_before_store_ids_still_opens(tmp_path, key):
    from kvsnap.store.index import BlockIndex
    from kvsnap.store.sealed_files import SealedStoreFiles

    old = SealedStoreFiles(tmp_path / "old", key)  # no store id: its index is bound to its path only
    (tmp_path / "old").mkdir()
    old.save_index(BlockIndex())
    (tmp_path / "old" / "kvsnap-store.json").write_text(json.dumps(old.marker()))
    assert "store_id" not in old.marker()["sealed"]
    chain = make_chain()
    put(BlockStore(tmp_path / "old"), chain, TOKENS, name="talk")
    assert [s.name for s in BlockStore(tmp_path / "old").sessions()] == ["talk"]
