"""``kvsnap store`` as users drive it: typer's CliRunner in-process, one subprocess for the no-torch check.

The stores are built the way a user builds one: ``kvsnap store import`` of ``.kv`` files. Two snapshots
share a system prompt and then differ, so the store holds the prompt's blocks once with two branches.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from core_helpers import FINGERPRINT, NAMESPACE, make_layout, read_everything
from typer.testing import CliRunner

from kvsnap import hashing
from kvsnap.format import SnapshotHeader, encode_block, write_snapshot
from kvsnap_cli.main import app

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
BS = 4
LAYOUT = make_layout()  # float32, 2 layers x 2 kv heads x 4: 128 bytes a token
WORDS = ["you", "are", "a", "helpful", "cache", "assistant", "answer", "briefly", "what", "is", "capital", "of"]
WORDS += ["italy", "paris"]
SYSTEM = "you are a helpful cache assistant answer briefly"  # 8 words: two blocks
ROME = SYSTEM + " what is capital of italy"  # + 5 tokens: one full block and a tail of 1
PARIS = SYSTEM + " what capital is paris"  # + 4: one full block, diverging from ROME's in its second token
COMMANDS = ["stats", "sessions", "tree", "gc", "check", "budget", "pin", "unpin", "rm", "export", "import"]


def invoke(*args: str | Path):
    return runner.invoke(app, ["store", *map(str, args)])


def ok(*args: str | Path):
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    return result


def ok_json(*args: str | Path) -> dict:
    return json.loads(ok(*args, "--json").stdout)


def one_error_line(result) -> str:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A model folder holding only a word-level tokenizer: enough for ``find_tokenizer``, no weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("tok-model")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="you"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "config.json").write_text("{}")
    return folder


def encode(text: str) -> list[int]:
    return [WORDS.index(w) for w in text.split()]


def fake_raw(tokens: list[int], start: int) -> bytes:
    """A block's KV as a function of its position and tokens: equal prefixes carry equal KV, as with a model."""
    n = len(tokens) * LAYOUT.bytes_per_token // 4
    seed = int.from_bytes(hashlib.blake2b(repr((start, tokens)).encode(), digest_size=4).digest(), "little")
    return np.random.default_rng(seed).standard_normal(n).astype("<f4").tobytes()


def write_kv(path: Path, tokens: list[int], model: str) -> list[bytes]:
    """A ``.kv`` snapshot of ``tokens`` (like core_helpers.write_test_snapshot, but with chosen tokens and model)."""
    root = hashing.chain_root(FINGERPRINT, NAMESPACE, BS)
    hashes = hashing.chain_hashes(tokens, BS, root)
    raws, blocks = [], []
    for i, start in enumerate(range(0, len(tokens), BS)):
        part = tokens[start : start + BS]
        raws.append(fake_raw(part, start))
        h = hashes[i] if i < len(hashes) else None
        blocks.append(encode_block(raws[-1], len(part), h, LAYOUT.itemsize, "shuffle-zstd", 1))
    write_snapshot(
        path,
        SnapshotHeader(
            model=model, fingerprint=FINGERPRINT, root=root, layout=LAYOUT, block_size=BS, codec="shuffle-zstd", level=1
        ),
        tokens,
        blocks,
    )
    return raws


@pytest.fixture
def store(tmp_path, tokenizer_dir) -> Path:
    """A store of two imported sessions, ``rome`` and ``paris``, sharing the system prompt's two blocks."""
    folder = tmp_path / "store"
    for name, text in (("rome", ROME), ("paris", PARIS)):
        write_kv(tmp_path / f"{name}.kv", encode(text), str(tokenizer_dir))
        ok("import", folder, tmp_path / f"{name}.kv")
    return folder


def stored_part(path: Path) -> bytes:
    """A block file's stored bytes: what is before its trailer (JSON, u32 length, 8-byte magic)."""
    data = path.read_bytes()
    (length,) = struct.unpack("<I", data[-12:-8])
    return data[: -12 - length]


def block_file(store: Path, tokens: list[int], i: int) -> Path:
    h = hashing.chain_hashes(tokens, BS, hashing.chain_root(FINGERPRINT, NAMESPACE, BS))[i].hex()
    return store / "blocks" / h[:2] / f"{h}.blk"


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
def test_every_store_command_has_help(command):
    result = invoke(command, "--help")
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output and "DIR" in result.output


def test_import_dedups_the_shared_prefix(tmp_path, tokenizer_dir):
    write_kv(tmp_path / "rome.kv", encode(ROME), str(tokenizer_dir))
    write_kv(tmp_path / "paris.kv", encode(PARIS), str(tokenizer_dir))
    first = ok_json("import", tmp_path / "s", tmp_path / "rome.kv")
    assert first["session"] == "rome" and (first["new_blocks"], first["reused_blocks"]) == (4, 0)
    second = ok_json("import", tmp_path / "s", tmp_path / "paris.kv", "--name", "fr", "--pin")
    assert second["session"] == "fr" and (second["new_blocks"], second["reused_blocks"]) == (1, 2)
    assert second["stored_tokens"] == len(encode(PARIS))
    names = {s["name"]: s for s in ok_json("sessions", tmp_path / "s")["sessions"]}
    assert set(names) == {"rome", "fr"} and names["fr"]["pinned"] and not names["rome"]["pinned"]
    assert names["rome"]["tokens"] == 13 and names["rome"]["present_blocks"] == names["rome"]["blocks"] == 4
    plain = ok("import", tmp_path / "s", tmp_path / "rome.kv", "--name", "again")
    assert "session 'again'" in plain.stdout and "0 new blocks, 4 already stored" in plain.stdout


def test_stats_json_fields(store):
    info = ok_json("stats", store)
    assert (info["blocks"], info["sessions"], info["budget_bytes"], info["hits"], info["evictions"]) == (
        5,
        2,
        None,
        0,
        0,
    )
    files = list((store / "blocks").rglob("*.blk"))
    assert len(files) == 5 and info["bytes"] == sum(len(stored_part(f)) for f in files)  # trailers not counted
    assert info["raw_bytes"] == (8 + 5 + 4) * LAYOUT.bytes_per_token  # the shared 8 tokens counted once
    text = ok("stats", store).stdout
    assert "5 (2 leaves)" in text and "budget" in text and "none" in text


def test_tree_shows_the_shared_prefix_once_with_two_branches(store):
    view = ok_json("tree", store)
    (root,) = view["roots"]
    (shared,) = root["children"]
    assert shared["tokens"] == 8 and shared["blocks"] == 2 and shared["text"] == SYSTEM
    branches = {tuple(b["sessions"]): b for b in shared["children"]}
    assert set(branches) == {("rome",), ("paris",)}
    assert branches[("rome",)]["text"] == "what is capital of italy" and branches[("rome",)]["partial"]
    paris = branches[("paris",)]
    assert (paris["text"], paris["tokens"], paris["blocks"], paris["partial"]) == ("what capital is paris", 4, 1, False)

    text = ok("tree", store).stdout
    assert text.count("'you are a helpful cache assistant answer briefly'") == 1
    assert text.count("8 tokens") == text.count("5 tokens") == text.count("4 tokens") == 1
    assert "'what is capital of italy'" in text and "'what capital is paris'" in text
    assert "<- rome" in text and "<- paris" in text and "last use" in text


def test_tree_depth_hides_the_branches(store):
    (shared,) = ok_json("tree", store, "--depth", "1")["roots"][0]["children"]
    assert shared["children"] == [] and shared["hidden_nodes"] == 2
    text = ok("tree", store, "--depth", "1").stdout
    assert "2 more nodes below" in text and "rome" not in text


def test_tree_without_the_tokenizer_shows_token_counts(store, tokenizer_dir):
    (tokenizer_dir / "config.json").rename(tokenizer_dir / "config.json.off")
    try:
        view = ok_json("tree", store)
        text = ok("tree", store).stdout
    finally:
        (tokenizer_dir / "config.json.off").rename(tokenizer_dir / "config.json")
    (shared,) = view["roots"][0]["children"]
    assert "text" not in shared and shared["tokens"] == 8
    assert "8 tokens" in text and "helpful" not in text


def test_pin_unpin_rm(store):
    assert ok_json("pin", store, "rome") == {"session": "rome", "pinned": True}
    assert ok_json("stats", store)["pinned_sessions"] == 1
    assert "pinned session 'rome'" in ok("pin", store, "rome").stdout
    assert ok_json("unpin", store, "rome")["evicted"] == 0
    assert ok_json("stats", store)["pinned_sessions"] == 0
    removed = ok_json("rm", store, "paris")
    assert removed["removed"] and removed["evicted"] == 0
    assert [s["name"] for s in ok_json("sessions", store)["sessions"]] == ["rome"]
    assert ok_json("stats", store)["blocks"] == 5  # a removed session's blocks stay, as cache
    for command in ("pin", "unpin", "rm", "export"):
        extra = ["x.kv"] if command == "export" else []
        assert "no session 'nope'" in one_error_line(invoke(command, store, "nope", *extra))


def test_budget_evicts_leaves_and_keeps_pins(store):
    ok("pin", store, "rome")
    result = ok_json("budget", store, "0")
    # paris's own block goes; the shared prefix is an inner node, and rome's, pinned.
    assert result["evicted"] == 1 and result["blocks"] == 4 and result["budget_bytes"] == 0
    human = ok("budget", store, "0")
    assert "evicted 0 blocks" in human.stdout and "still over the budget" in human.stderr
    unpinned = ok_json("unpin", store, "rome")
    assert unpinned["evicted"] == 4
    stats = ok_json("stats", store)
    assert (stats["blocks"], stats["bytes"], stats["evictions"]) == (0, 0, 5)
    assert ok_json("budget", store, "none")["budget_bytes"] is None
    assert ok_json("budget", store, "2MB")["budget_bytes"] == 2_000_000
    assert "cannot read '12XB' as a size" in one_error_line(invoke("budget", store, "12XB"))


def test_export_import_round_trip(store, tmp_path, tokenizer_dir):
    out = tmp_path / "out" / "rome-again.kv"
    out.parent.mkdir()
    info = ok_json("export", store, "rome", out)
    assert info["tokens"] == 13 and info["blocks"] == 4 and info["file_bytes"] == out.stat().st_size
    got = read_everything(out)
    assert got["tokens"] == encode(ROME)
    assert got["blocks"] == [fake_raw(encode(ROME)[s : s + BS], s) for s in range(0, 13, BS)]
    assert got["meta"].model == str(tokenizer_dir)

    other = tmp_path / "other"
    back = ok_json("import", other, out, "--pin")
    assert back["session"] == "rome-again" and back["new_blocks"] == 4 and back["stored_tokens"] == 13
    again = tmp_path / "again.kv"
    assert "wrote session 'rome-again'" in ok("export", other, "rome-again", again).stdout
    assert read_everything(again)["blocks"] == got["blocks"]
    missing_folder = one_error_line(invoke("export", store, "rome", tmp_path / "no" / "x.kv"))
    assert "x.kv" in missing_folder


def test_import_of_a_bad_file_leaves_no_store(tmp_path):
    bad = tmp_path / "bad.kv"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    for file in (bad, tmp_path / "missing.kv"):
        assert file.name in one_error_line(invoke("import", tmp_path / "new", file))
        assert not (tmp_path / "new").exists()


def test_gc_removes_leftovers_and_reports(store):
    stray = store / "blocks" / "ab" / ("ab" * 16 + ".blk")
    stray.parent.mkdir(exist_ok=True)
    stray.write_bytes(b"orphan")
    temp = store / ".index.json.abcdefgh.tmp"
    temp.write_bytes(b"half")
    report = ok_json("gc", store)
    assert (report["temp_files"], report["orphan_files"], report["dropped_blocks"], report["evicted"]) == (1, 1, 0, 0)
    assert report["blocks"] == 5 and not stray.exists() and not temp.exists()
    assert "removed 0 temp files and 0 orphan files" in ok("gc", store).stdout


def test_check_finds_a_damaged_block_and_gc_repairs_it(store):
    assert "sound (5 blocks verified, 2 sessions)" in ok("check", store).stdout
    damaged = block_file(store, encode(ROME), 2)  # rome's own full block, above its tail
    data = bytearray(damaged.read_bytes())
    data[3] ^= 0x40
    damaged.write_bytes(bytes(data))

    result = invoke("check", store)
    assert "1 problem found" in one_error_line(result)
    assert f"{damaged}: block is damaged" in result.stdout
    as_json = invoke("check", store, "--json")
    assert as_json.exit_code == 1 and json.loads(as_json.stdout)["problems"] == [
        f"{damaged}: block is damaged (checksum mismatch)"
    ]

    report = ok_json("gc", store)
    assert report["dropped_blocks"] == 2 and report["blocks"] == 3  # the damaged block and rome's tail below it
    assert json.loads(ok("check", store, "--json").stdout) == {"path": str(store), "ok": True, "problems": []}


def test_missing_store_is_one_line_and_creates_nothing(tmp_path):
    nowhere = tmp_path / "nowhere"
    for args in (
        ["stats"], ["sessions"], ["tree"], ["gc"], ["check"], ["budget", "1MB"], ["pin", "a"], ["unpin", "a"],
        ["rm", "a"], ["export", "a", tmp_path / "a.kv"],
    ):  # fmt: skip
        line = one_error_line(invoke(args[0], nowhere, *args[1:]))
        assert "nowhere: no kvsnap block store here" in line, args
    assert not nowhere.exists() and not (tmp_path / "a.kv").exists()


def test_store_commands_do_not_import_torch(store, tmp_path):
    code = (
        "import sys; from kvsnap_cli.main import app\n"
        f"for args in {[['tree'], ['stats'], ['check'], ['gc'], ['budget', '1MB'], ['pin', 'rome']]!r}:\n"
        f"    try:\n        app(['store', args[0], {str(store)!r}, *args[1:], '--json'])\n"
        "    except SystemExit as e:\n        assert not e.code, (args, e.code)\n"
        f"try:\n    app(['store', 'export', {str(store)!r}, 'rome', {str(tmp_path / 'r.kv')!r}])\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"
        f"try:\n    app(['store', 'import', {str(tmp_path / 'new')!r}, {str(tmp_path / 'r.kv')!r}])\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=os.environ)
    assert proc.returncode == 0, proc.stderr
    tree = json.loads(proc.stdout.splitlines()[0])
    assert tree["roots"][0]["children"][0]["text"] == SYSTEM  # the tokenizer path ran too


def test_every_store_command_defaults_to_the_one_store_setting(store, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSNAP_STORE", str(store))
    assert ok_json("stats")["sessions"] == 2
    assert [s["name"] for s in ok_json("sessions")["sessions"]] == ["paris", "rome"]
    assert ok_json("pin", "rome") == {"session": "rome", "pinned": True}
    assert ok_json("budget", "none")["budget_bytes"] is None
    assert ok_json("export", "rome", tmp_path / "r.kv")["tokens"] == 13
    assert ok_json("import", tmp_path / "r.kv", "--name", "again")["reused_blocks"] == 4
    assert ok_json("check")["ok"] and ok_json("tree")["path"] == str(store)
    assert ok_json("rm", "again")["removed"] and ok_json("unpin", "rome")["pinned"] is False
    assert ok_json("gc")["blocks"] == 5
    # Without KVSNAP_STORE: $KVSNAP_HOME/store, which run, chat and serve use too.
    monkeypatch.delenv("KVSNAP_STORE")
    monkeypatch.setenv("KVSNAP_HOME", str(tmp_path / "home"))
    assert f"{tmp_path / 'home' / 'store'}: no kvsnap block store here" in one_error_line(invoke("stats"))


def test_a_store_command_given_too_many_or_too_few_arguments_is_a_usage_error(store):
    for args in (["pin"], ["pin", store, "rome", "extra"], ["export", "rome"], ["budget"]):
        result = invoke(*args)
        assert result.exit_code == 2, args
        assert "[DIR]" in result.output
