"""The block store's faults (issue 13), as users meet them: foreign folders, special files, huge files,
narrow or lossy imports, a store that cannot be written, a lost index, index entries edited by hand.

Each test names the case of the issue it guards. Stores are built with the library (two sessions
sharing two blocks) or by ``kvsnap run --store`` with the tiny Llama; the faults are made the way a
tester made them (a FIFO, a truncate, a symlink, a full disk simulated at the store's one write
function), and the outcome is checked as a user sees it: exit code, one error line, what
``kvsnap store check`` says, which files are still there.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import struct
import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from core_helpers import FINGERPRINT, MODEL, NAMESPACE, make_layout, write_test_snapshot
from typer.testing import CliRunner

from kvsnap import hashing
from kvsnap.config import SamplingParams
from kvsnap.format import encode_block
from kvsnap.store import BlockStore, ChainInfo, StoreError, block_keys
from kvsnap.store import files as store_files
from kvsnap_cli.main import app

runner = CliRunner()
BS = 4
LAYOUT = make_layout()  # float32, 128 bytes a token
ROOT = hashing.chain_root(FINGERPRINT, NAMESPACE, BS)
CHAIN = ChainInfo(ROOT, MODEL, FINGERPRINT, LAYOUT, BS)
A = list(range(100, 113))  # three full blocks and a tail of one
B = list(range(100, 108)) + [7, 7, 7, 7]  # shares A's first two blocks
PROMPT = "Blocks of tokens are hashed in a chain, so a prefix is found by its last block alone. " * 3


def invoke(*args: str | Path):
    return runner.invoke(app, [str(a) for a in args])


def one_error_line(result) -> str:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    return lines[0]


def blocks_of(tokens: list[int]):
    hashes = hashing.chain_hashes(tokens, BS, ROOT)
    out = []
    for i, start in enumerate(range(0, len(tokens), BS)):
        part = tokens[start : start + BS]
        seed = int.from_bytes(hashlib.blake2b(repr((start, part)).encode(), digest_size=4).digest(), "little")
        raw = np.random.default_rng(seed).standard_normal(len(part) * LAYOUT.bytes_per_token // 4).astype("<f4")
        out.append(encode_block(raw.tobytes(), len(part), hashes[i] if i < len(hashes) else None, 4, "shuffle-zstd", 1))
    return out


def make_store(path: Path) -> BlockStore:
    """Sessions ``a`` and ``b``: five blocks, the first two shared."""
    store = BlockStore(path)
    store.add_session("a", CHAIN, A, blocks_of(A), codec="shuffle-zstd", last_logits=np.arange(5, dtype=np.float32))
    store.add_session("b", CHAIN, B, blocks_of(B), codec="shuffle-zstd")
    return store


def block_path(store_dir: Path, tokens: list[int], i: int) -> Path:
    h = block_keys(tokens, BS, ROOT)[i].hex()  # a partial tail block's too
    return store_dir / "blocks" / h[:2] / f"{h}.blk"


def block_files(store_dir: Path) -> set[Path]:
    return set((store_dir / "blocks").rglob("*.blk"))


def edit_index(store_dir: Path, h: bytes, **fields) -> None:
    index = json.loads((store_dir / "index.json").read_text())
    for b in index["blocks"]:
        if b["hash"] == h.hex():
            b.update(fields)
    (store_dir / "index.json").write_text(json.dumps(index))


def strip_trailer(path: Path) -> None:
    """Make a block file look like one an older kvsnap wrote: its stored bytes alone."""
    data = path.read_bytes()
    (length,) = struct.unpack("<I", data[-12:-8])
    path.write_bytes(data[: -12 - length])


def check_json(store_dir: Path) -> dict:
    return json.loads(invoke("store", "check", store_dir, "--json").stdout)


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


def run_args(model: str, store_dir: Path, prompt: str = PROMPT, *extra: str) -> list[str]:
    return [
        "run", "--model", model, "--device", "cpu", "--block-size", "16", "--store", str(store_dir),
        "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "4", *extra,
    ]  # fmt: skip


def fail_writes(monkeypatch, under: str = "") -> None:
    """The store's disk is full (for files whose path contains ``under``); .kv saves still work."""
    real = store_files.replace_whole

    def full(path, parts, *args, **kwargs):
        if under in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, parts, *args, **kwargs)

    monkeypatch.setattr(store_files, "replace_whole", full)


# -- 1: a store is a folder kvsnap made; upkeep deletes only what kvsnap wrote ----------------------


def test_a_folder_holding_other_files_never_becomes_a_store(tmp_path):
    """Case 1: `run --store DIR` and `store import DIR` took any non-empty folder (a mistyped KVSNAP_STORE)."""
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    (folder / "draft.tmp").write_text("mine too")
    kv = write_test_snapshot(tmp_path / "x.kv").path
    with pytest.raises(StoreError, match="not a kvsnap block store"):
        BlockStore(folder)
    for args in (["import", folder, kv], ["gc", folder], ["check", folder], ["stats", folder]):
        line = one_error_line(invoke("store", *args))
        assert "not a kvsnap block store (no kvsnap-store.json); choose an empty or new folder" in line, args
    assert sorted(p.name for p in folder.iterdir()) == ["draft.tmp", "notes.txt"]


def test_run_refuses_a_folder_that_is_not_a_store(tmp_path, model):
    """Case 1: a mistyped --store path pointing at someone's folder is an error before any work, not a new store."""
    folder = tmp_path / "documents"
    folder.mkdir()
    (folder / "letter.txt").write_text("dear")
    assert "not a kvsnap block store" in one_error_line(invoke(*run_args(model, folder)))
    assert [p.name for p in folder.iterdir()] == ["letter.txt"]


def test_gc_deletes_only_what_kvsnap_wrote_and_names_the_rest(tmp_path):
    """Case 1: gc removed a user's notes.txt-like files, a *.tmp and a file under blocks/ as temp and orphan files."""
    store_dir = tmp_path / "store"
    make_store(store_dir)
    ab = store_dir / "blocks" / "ab"
    ab.mkdir(exist_ok=True)
    foreign = [
        store_dir / "notes.txt",
        store_dir / "draft.tmp",
        store_dir / ".draft.abcdefgh.tmp",  # kvsnap's temp pattern, but not for a file kvsnap writes
        store_dir / "blocks" / "readme.txt",
        ab / "notes.tmp",
        ab / ".notes.txt.abcdefgh.tmp",
        ab / ("cd" * 16 + ".blk"),  # a block's name in the wrong folder
    ]
    for p in foreign:
        p.write_text("mine")
    leftovers = [store_dir / ".index.json.abcdefgh.tmp", ab / f".{'ab' * 16}.blk.abcdefgh.tmp", ab / f"{'ab' * 16}.blk"]
    for p in leftovers:
        p.write_bytes(b"half")

    problems = check_json(store_dir)["problems"]
    assert sum("not a file kvsnap writes" in p for p in problems) == len(foreign)
    assert sum("a temp file a killed writer left (gc removes it)" in p for p in problems) == 2
    assert len(problems) == len(foreign) + 2
    result = invoke("store", "gc", store_dir)
    assert result.exit_code == 0, result.output
    assert "removed 2 temp files and 1 orphan file" in result.stdout
    assert "left alone 7 files kvsnap did not write" in result.stderr and "blocks/readme.txt" in result.stderr
    assert all(p.exists() for p in foreign) and not any(p.exists() for p in leftovers)
    report = json.loads(invoke("store", "gc", store_dir, "--json").stdout)
    assert sorted(report["unknown"]) == sorted(str(p.relative_to(store_dir)) for p in foreign)
    assert BlockStore(store_dir).stats()["blocks"] == 5


def test_a_store_of_the_previous_version_is_adopted_but_a_foreign_index_is_not(tmp_path):
    """Case 1: stores made before the marker existed keep working; a folder with any index.json does not pass."""
    store_dir = tmp_path / "old"
    make_store(store_dir)
    (store_dir / "kvsnap-store.json").unlink()
    assert BlockStore(store_dir, create=False).stats()["sessions"] == 2
    assert json.loads((store_dir / "kvsnap-store.json").read_text()) == {"format": "kvsnap-store", "version": 1}

    other = tmp_path / "other"
    other.mkdir()
    (other / "index.json").write_text('{"pages": []}')
    assert "not a kvsnap block store" in one_error_line(invoke("store", "gc", other))
    assert [p.name for p in other.iterdir()] == ["index.json"]


# -- 5: never open a non-regular file, never follow a link inside the store -------------------------


def test_a_fifo_in_place_of_a_block_is_a_miss_not_a_hang(tmp_path):
    """Case 5: a FIFO at a block's path hung every reader forever, holding the store's lock."""
    store_dir = tmp_path / "store"
    store = make_store(store_dir)
    fifo = block_path(store_dir, A, 1)
    fifo.unlink()
    os.mkfifo(fifo)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(store.fetch(A, ROOT, BS)), daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "the read hung on the FIFO"
    match, blocks = got[0]
    assert match.hit_tokens == 4 and len(blocks) == 1
    assert "not a regular file" in match.dropped[0]
    store.put(CHAIN, A[:8], blocks_of(A[:8]), codec="shuffle-zstd")  # the lock is free; the block is back
    assert fifo.is_fifo() is False and fifo.is_file()  # replaced by the real block (a rename over the FIFO)
    assert check_json(store_dir) == {"path": str(store_dir), "ok": True, "problems": []}


def test_links_inside_the_store_are_never_followed(tmp_path):
    """Case 5/7: a symlink at a block's path (even to a valid copy) or a linked blocks/xx folder is refused."""
    store_dir = tmp_path / "store"
    make_store(store_dir)
    outside = tmp_path / "outside"
    outside.mkdir()
    target = block_path(store_dir, A, 2)
    copy = outside / target.name
    copy.write_bytes(target.read_bytes())
    target.unlink()
    target.symlink_to(copy)
    folder = block_path(store_dir, B, 2).parent
    if folder != target.parent:
        moved = outside / folder.name
        folder.rename(moved)
        folder.symlink_to(moved, target_is_directory=True)
    problems = check_json(store_dir)["problems"]
    assert any(str(target) in p and "is a link" in p for p in problems), problems
    if folder != target.parent:
        assert any("not followed" in p and str(folder) in p for p in problems), problems
    assert BlockStore(store_dir).fetch(A, ROOT, BS)[0].hit_tokens == 8
    assert copy.read_bytes()  # the link's target is untouched


# -- 7: sizes are checked before anything is read ---------------------------------------------------


def _peak_mb(fn) -> float:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 1e6
    finally:
        tracemalloc.stop()


def test_a_block_file_grown_to_gigabytes_is_refused_unread(tmp_path):
    """Case 7: a 2.7 KB block truncated up to 1.5 GB was read whole (1.6 GB RSS, MemoryError in check and gc)."""
    store_dir = tmp_path / "store"
    store = make_store(store_dir)
    big = block_path(store_dir, A, 2)
    os.truncate(big, 1_500_000_000)  # sparse: no disk used
    problems: list[str] = []
    assert _peak_mb(lambda: problems.extend(store.check())) < 20
    assert problems == [f"{big}: block file holds 1,500,000,000 bytes, its entry {len(blocks_of(A)[2].stored):,} "
                        "(damaged); not read"]  # fmt: skip
    assert _peak_mb(store.gc) < 20
    assert not big.exists() and store.check() == []


def test_a_link_to_dev_zero_is_refused(tmp_path):
    """Case 7: a block file replaced by a symlink to /dev/zero was followed and read without end."""
    store_dir = tmp_path / "store"
    store = make_store(store_dir)
    link = block_path(store_dir, A, 0)
    link.unlink()
    link.symlink_to("/dev/zero")
    match, _ = store.fetch(A, ROOT, BS)
    assert match.hit_tokens == 0 and "is a link" in match.dropped[0]
    assert Path("/dev/zero").exists() and link.is_symlink()  # never deleted: kvsnap did not write it
    assert any("(a link)" in p for p in check_json(store_dir)["problems"])


def test_an_index_or_logits_file_grown_huge_is_refused_unread(tmp_path):
    """Case 7: the same for index.json and a session's logits: bounded reads, a one-line reason."""
    store_dir = tmp_path / "store"
    store = make_store(store_dir)
    blob = next((store_dir / "blobs").rglob("*.f32"))
    os.truncate(blob, 200_000_000)
    problems: list[str] = []
    assert _peak_mb(lambda: problems.extend(store.check())) < 20
    assert problems == ["session 'a': last-position logits are missing or damaged"]
    with pytest.raises(StoreError, match="more than the 67,108,864 it may be"):
        store.read_session("a")
    os.truncate(store_dir / "index.json", (1 << 30) + 1)
    line = one_error_line(invoke("store", "stats", store_dir))
    assert "store index is 1,073,741,825 bytes, more than the 1,073,741,824 it may be" in line
    assert "kvsnap store check --repair" in line
    assert _peak_mb(lambda: pytest.raises(StoreError, store.stats)) < 20


# -- 9: the store keeps exact cache-dtype blocks; a failed import leaves nothing ------------------


@pytest.mark.parametrize(
    ("setting", "reason"),
    [({"kv_dtype": "float16"}, "stored as float16 (--kv-dtype)"), ({"codec": "int8-zstd"}, "lossy codec int8-zstd")],
)
def test_import_of_a_narrow_or_lossy_kv_is_refused_in_one_line(tmp_path, llama, setting, reason):
    """Case 9: a --kv-dtype float16 .kv gave `ValueError: block 0: 1536 raw bytes` (int8: "unknown codec")."""
    from kvsnap.engine.session import Session

    session = Session(llama, block_size=8, **setting)
    session.prefill(list(range(5, 30)))
    session.save(tmp_path / "x.kv")
    for folder, existed in ((tmp_path / "new", False), (tmp_path / "empty", True)):
        if existed:
            folder.mkdir()
        line = one_error_line(invoke("store", "import", folder, tmp_path / "x.kv"))
        assert reason in line and "the block store keeps exact cache-dtype blocks only" in line
        assert folder.exists() == existed and (not existed or not any(folder.iterdir()))


def test_a_failed_import_leaves_nothing_in_the_folder_it_made(tmp_path, monkeypatch):
    """Case 9: a failed import left its new store folder holding .lock (and now the marker and index)."""
    kv = write_test_snapshot(tmp_path / "x.kv", num_tokens=12).path
    fail_writes(monkeypatch, under=".blk")
    assert "No space left" in one_error_line(invoke("store", "import", tmp_path / "new", kv))
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("x")
    assert "not a kvsnap block store" in one_error_line(invoke("store", "import", tmp_path / "mine", kv))
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["keep.txt"]


# -- 12: a store that cannot be written is no store for this request, with a warning ----------------


def test_a_full_disk_store_still_answers_and_saves(tmp_path, model, monkeypatch):
    """Case 12: with the store's disk full every `run --store` failed, even a pure hit (a lookup rewrote the
    index); a run needing new blocks failed after generation, losing the answer and --save."""
    store_dir = tmp_path / "store"
    first = invoke(*run_args(model, store_dir), "--json")
    assert first.exit_code == 0, first.output
    index_before = (store_dir / "index.json").read_bytes()
    fail_writes(monkeypatch)

    hit = invoke(*run_args(model, store_dir), "--max-new-tokens", "0", "--json")
    assert hit.exit_code == 0, hit.output
    row = json.loads(hit.stdout)
    assert row["restored_from"] == "store" and row["store_error"] is None and "warning" not in hit.stderr

    save = tmp_path / "new.kv"
    new = invoke(*run_args(model, store_dir, "A different prompt, new blocks all the way. " * 4), "--save", save)
    assert new.exit_code == 0, new.output
    assert new.stdout.strip() and save.is_file()
    assert "warning: block store not updated" in new.stderr and "No space left on device" in new.stderr
    monkeypatch.undo()
    assert (store_dir / "index.json").read_bytes() == index_before
    assert check_json(store_dir)["ok"] and not list(store_dir.rglob("*.tmp"))


def test_an_unwritable_blocks_folder_is_a_warning_after_the_answer(tmp_path, model, monkeypatch):
    """Case 12: with blocks/ unwritable the failure came after generation and the answer and --save were lost."""
    store_dir = tmp_path / "store"
    fail_writes(monkeypatch, under=os.sep + "blocks" + os.sep)
    save = tmp_path / "a.kv"
    result = invoke(*run_args(model, store_dir), "--save", save, "--json")
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)
    assert row["text"] and row["saved"]["path"] == str(save) and save.is_file()
    assert row["store_error"].startswith("block store not updated:") and "cannot write" in row["store_error"]
    assert "warning: block store not updated" in result.stderr


def test_lookups_on_a_store_that_cannot_be_written_answer(tmp_path, monkeypatch):
    """Case 12: a lookup that only reads must not need to write the index."""
    store = make_store(tmp_path / "store")
    fail_writes(monkeypatch)
    assert store.lookup(A, ROOT, BS).hit_tokens == 12
    match, blocks = store.fetch(A, ROOT, BS)
    assert match.hit_tokens == 12 and len(blocks) == 3
    store.put(CHAIN, A, blocks_of(A)[:3], codec="shuffle-zstd")  # nothing new: only recency would change
    with pytest.raises(StoreError, match="No space left"):
        store.put(CHAIN, A + [1, 2, 3], blocks_of(A + [1, 2, 3]), codec="shuffle-zstd")
    assert store.stats()["lookups"] == 0  # nothing was recorded, nothing broke


# -- 13: the index has a way back ------------------------------------------------------------------


def test_a_truncated_index_is_rebuilt_by_check_repair(tmp_path):
    """Case 13: a truncated index made `run` and `gc` fail with no way back."""
    store_dir = tmp_path / "store"
    make_store(store_dir)
    files = block_files(store_dir)
    index = store_dir / "index.json"
    index.write_bytes(index.read_bytes()[: index.stat().st_size // 2])

    line = one_error_line(invoke("store", "gc", store_dir))
    assert "not valid JSON" in line and "kvsnap store check --repair" in line
    assert block_files(store_dir) == files
    assert "not valid JSON" in check_json(store_dir)["problems"][0]
    repaired = invoke("store", "check", "--repair", store_dir)
    assert repaired.exit_code == 0, repaired.output
    assert f"index was unreadable; kept as {store_dir / 'index.damaged.json'}" in repaired.stdout
    assert (
        "recovered 5 blocks from the block files" in repaired.stdout and "sound (5 blocks verified" in repaired.stdout
    )
    assert "session records, pins and the budget were in the index" in repaired.stderr
    store = BlockStore(store_dir)
    match, blocks = store.fetch(A, ROOT, BS)
    assert match.hit_tokens == 12 and [b.data for b in blocks] == [b.stored for b in blocks_of(A)[:3]]
    # Only session a's logits go: they belonged to a session record, and those lived in the lost index.
    assert json.loads(invoke("store", "gc", store_dir, "--json").stdout)["orphan_files"] == 1
    assert block_files(store_dir) == files and (store_dir / "index.damaged.json").is_file()


def test_a_deleted_index_is_not_an_empty_store(tmp_path):
    """Case 13: a deleted index was silently rebuilt empty, and gc then deleted the old sessions' files."""
    store_dir = tmp_path / "store"
    store = make_store(store_dir)
    files = block_files(store_dir)
    (store_dir / "index.json").unlink()
    line = one_error_line(invoke("store", "gc", store_dir))
    assert "store index is missing" in line and "kvsnap store check --repair" in line
    with pytest.raises(StoreError, match="missing"):
        store.put(CHAIN, [1, 2, 3, 4], blocks_of([1, 2, 3, 4]), codec="shuffle-zstd")
    assert block_files(store_dir) == files and not (store_dir / "index.json").exists()
    report = store.repair()
    assert (report.index, report.recovered_blocks, report.unproven) == ("missing", 5, ())
    assert store.check() == [] and store.stats()["blocks"] == 5 and block_files(store_dir) == files


def test_repair_adds_only_what_block_files_prove(tmp_path):
    """Case 13: what cannot be proven (an old file without a trailer, an edited trailer, a block below it)
    is reported and kept, never deleted; blocks a crash left out of the index are proven and added."""
    store_dir = tmp_path / "store"
    store = BlockStore(store_dir)
    store.add_session("b", CHAIN, B, blocks_of(B), codec="shuffle-zstd")
    before_a = (store_dir / "index.json").read_bytes()
    store.add_session("a", CHAIN, A, blocks_of(A), codec="shuffle-zstd")
    (store_dir / "index.json").write_bytes(before_a)  # a's own blocks written, its index write lost
    report = store.repair()
    assert (report.index, report.kept_blocks, report.recovered_blocks) == ("sound", 3, 2)
    assert store.fetch(A, ROOT, BS)[0].hit_tokens == 12

    old, edited = block_path(store_dir, B, 2), block_path(store_dir, A, 2)
    strip_trailer(old)
    data = edited.read_bytes()
    edited.write_bytes(data.replace(b'"tokens":[108,109,110,111]', b'"tokens":[108,109,110,999]'))
    (store_dir / "index.json").unlink()
    report = store.repair()
    assert report.recovered_blocks == 2  # A's first two blocks
    unproven = dict(line.split(": ", 1) for line in report.unproven)
    assert "no trailer" in unproven[str(old.relative_to(store_dir))]
    assert "not the chained hash" in unproven[str(edited.relative_to(store_dir))]
    assert "parent block is not in the store" in unproven[str(block_path(store_dir, A, 3).relative_to(store_dir))]
    assert old.is_file() and edited.is_file() and store.check() == []


def test_block_files_of_the_previous_version_are_still_read(tmp_path):
    """Case 13: block files written before trailers existed keep working while their index entry vouches."""
    store_dir = tmp_path / "store"
    store = make_store(store_dir)
    for path in block_files(store_dir):
        strip_trailer(path)
    assert store.check() == []
    match, blocks = store.fetch(A, ROOT, BS)
    assert match.hit_tokens == 12 and [b.data for b in blocks] == [b.stored for b in blocks_of(A)[:3]]


# -- 14: check reads what run reads; a block that cannot be used is a miss -------------------------


def test_an_edited_raw_size_is_found_by_check_and_is_a_miss_for_runs(tmp_path):
    """Case 14: an index whose raw_bytes was edited passed `store check` while every run failed ("does not decode")."""
    store_dir = tmp_path / "store"
    store = make_store(store_dir)
    h = hashing.chain_hashes(A, BS, ROOT)[1]
    edit_index(store_dir, h, raw_bytes=999)
    result = invoke("store", "check", store_dir)
    assert "1 problem found" in one_error_line(result)
    assert "index entry is damaged (999 raw bytes recorded, but 4 tokens of this cache hold 512)" in result.stdout
    match, _ = store.fetch(A, ROOT, BS)
    assert match.hit_tokens == 4 and "dropped damaged block" in match.dropped[0]
    assert store.check() == [] and store.stats()["damaged"] == 1

    edit_index(store_dir, hashing.chain_hashes(A, BS, ROOT)[0], raw_bytes=1)
    assert json.loads(invoke("store", "gc", store_dir, "--json").stdout)["dropped_blocks"] == 1
    assert store.check() == []


def test_a_block_that_does_not_decode_is_dropped_during_a_run(tmp_path, llama):
    """Case 14: a block whose bytes pass their checksum but do not decode made every run fail."""
    from kvsnap.engine.session import Session

    store_dir = tmp_path / "store"
    store = BlockStore(store_dir)
    prompt = list(range(5, 45))
    greedy = SamplingParams(max_new_tokens=4, temperature=0)
    Session(llama, block_size=8, store=store).run(prompt, greedy)
    root = Session(llama, block_size=8).root()
    h = hashing.chain_hashes(prompt, 8, root)[2]
    strip_trailer(store_dir / "blocks" / h.hex()[:2] / f"{h.hex()}.blk")  # an old file: no trailer to compare
    edit_index(store_dir, h, codec="zstd")  # a lossless codec, but not the one its bytes are in

    result = Session(llama, block_size=8, store=store).run(prompt, greedy)
    assert result.hit_tokens == 16 and result.restored_from == "store"
    assert "dropped damaged block" in result.store_error and "does not decode" in result.store_error
    assert result.text == Session(llama, block_size=8).run(prompt, greedy).text
    assert store.check() == []


def test_a_folder_at_a_block_path_neither_breaks_runs_nor_survives_gc(tmp_path, model):
    """Case 14: a folder sitting at a block's path made every run fail, and gc did not fix it."""
    store_dir = tmp_path / "store"
    assert invoke(*run_args(model, store_dir)).exit_code == 0
    victim = sorted(block_files(store_dir))[0]
    victim.unlink()
    victim.mkdir()
    result = invoke(*run_args(model, store_dir), "--json")
    assert result.exit_code == 0, result.output
    assert "block file is a folder" in json.loads(result.stdout)["store_error"]
    assert victim.is_file() and check_json(store_dir)["ok"]  # dropped, the empty folder cleared, stored again

    # A folder with someone's file in it is never deleted: runs warn and go on, check and gc name it.
    victim.unlink()
    victim.mkdir()
    (victim / "mine.txt").write_text("x")
    result = invoke(*run_args(model, store_dir), "--json")
    assert result.exit_code == 0, result.output
    assert "block store not updated" in json.loads(result.stdout)["store_error"]
    rel = str(victim.relative_to(store_dir))
    assert f"{rel} (a folder): not a file kvsnap writes (gc leaves it alone)" in check_json(store_dir)["problems"]
    stray = store_dir / "blocks" / "ab" / ("ab" * 16 + ".blk")
    stray.mkdir(parents=True)
    assert any("a folder where a block belongs" in p for p in check_json(store_dir)["problems"])
    gc = invoke("store", "gc", store_dir)
    assert gc.exit_code == 0 and f"left alone 1 file kvsnap did not write: {rel} (a folder)" in gc.stderr
    assert not stray.exists() and (victim / "mine.txt").is_file()
