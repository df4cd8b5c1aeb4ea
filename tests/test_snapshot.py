"""The ``.kv`` snapshot file: round trip, lazy reads, damage, foreign files and atomic writes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from core_helpers import (
    FINGERPRINT,
    MODEL,
    NAMESPACE,
    assert_one_line,
    make_layout,
    read_everything,
    read_header,
    rewrite_meta,
    rewrite_meta_text,
    tensor_span,
    write_test_snapshot,
)
from safetensors import safe_open
from safetensors.numpy import save_file

from kvsnap import hashing
from kvsnap.errors import ForeignSnapshotError, KvsnapError, SnapshotError, SnapshotVersionError
from kvsnap.format import FORMAT_VERSION, Snapshot, SnapshotHeader, block_name, write_snapshot
from kvsnap.format import codec as codecs
from kvsnap.types import EncodedBlock

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": 'Héllo — ünïcode 🦙\nsecond line, "quotes" and \\ backslash'},
    {"role": "assistant", "content": ""},
]


def _logits(vocab: int = 50) -> np.ndarray:
    logits = np.random.default_rng(7).standard_normal(vocab).astype(np.float32) * 10
    logits[:3] = [-np.inf, np.float32(-0.0), np.float32(1e-45)]  # odd values must survive bit for bit
    return logits


# ---------------------------------------------------------------------------------------------
# Round trip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize(
    ("num_tokens", "num_blocks"),
    [(0, 0), (3, 1), (4, 1), (37 * 4, 37), (37 * 4 + 3, 38)],
)
def test_round_trip_is_bit_identical(tmp_path, dtype, num_tokens, num_blocks):
    w = write_test_snapshot(tmp_path / "s.kv", num_tokens=num_tokens, layout=make_layout(dtype))
    assert len(w.raws) == num_blocks
    got = read_everything(w.path)
    assert got["tokens"] == w.tokens
    assert got["blocks"] == w.raws
    assert got["logits"] is None
    meta = got["meta"]
    assert meta.format_version == FORMAT_VERSION
    assert (meta.model, meta.fingerprint, meta.root) == (MODEL, FINGERPRINT, w.root)
    assert meta.layout == w.layout and meta.layout.dtype == dtype
    assert (meta.block_size, meta.codec, meta.level, meta.num_tokens) == (4, "shuffle-zstd", 1, num_tokens)
    assert len(meta.blocks) == num_blocks
    assert [b.num_tokens for b in meta.blocks] == [min(4, num_tokens - 4 * i) for i in range(num_blocks)]
    assert meta.block_hashes == hashing.chain_hashes(w.tokens, 4, w.root)
    assert meta.kv_bytes == sum(len(r) for r in w.raws) == num_tokens * w.layout.bytes_per_token
    assert meta.stored_bytes == sum(len(b.stored) for b in w.blocks)
    assert meta.messages is None
    assert w.size == os.path.getsize(w.path)


@pytest.mark.parametrize("codec_name", codecs.CODECS)
def test_round_trip_with_every_codec(tmp_path, codec_name):
    w = write_test_snapshot(tmp_path / "s.kv", num_tokens=30, codec=codec_name, layout=make_layout("bfloat16"))
    got = read_everything(w.path)
    assert got["blocks"] == w.raws
    assert got["meta"].codec == codec_name


def test_partial_tail_block(tmp_path):
    w = write_test_snapshot(tmp_path / "s.kv", num_tokens=10)
    with Snapshot(w.path) as snap:
        tail = snap.meta.blocks[-1]
        assert (tail.num_tokens, tail.hash) == (2, None)
        assert all(b.hash is not None for b in snap.meta.blocks[:-1])
        assert tail.raw_bytes == 2 * w.layout.bytes_per_token
        assert bytes(snap.read_raw([2])[0]) == w.raws[2]


def test_last_logits_round_trip(tmp_path):
    logits = _logits()
    w = write_test_snapshot(tmp_path / "s.kv", num_tokens=9, last_logits=logits)
    with Snapshot(w.path) as snap:
        got = snap.last_logits()
    assert got.dtype == np.float32 and got.shape == logits.shape
    assert got.tobytes() == logits.tobytes()


def test_last_logits_absent(tmp_path):
    w = write_test_snapshot(tmp_path / "s.kv", num_tokens=9)
    with Snapshot(w.path) as snap:
        assert snap.last_logits() is None
        assert snap.meta.logits_checksum is None


def test_chat_messages_round_trip(tmp_path):
    w = write_test_snapshot(tmp_path / "s.kv", num_tokens=9, messages=MESSAGES, extra={"chat_template": "x"})
    with Snapshot(w.path) as snap:
        assert list(snap.meta.messages) == MESSAGES
        assert snap.meta.extra == {"chat_template": "x"}


def test_no_messages_and_empty_messages(tmp_path):
    w = write_test_snapshot(tmp_path / "a.kv", num_tokens=5)
    assert read_everything(w.path)["meta"].messages is None
    w = write_test_snapshot(tmp_path / "b.kv", num_tokens=5, messages=[])
    assert list(read_everything(w.path)["meta"].messages) == []


def test_file_is_a_valid_safetensors_file(tmp_path):
    w = write_test_snapshot(tmp_path / "s.kv", num_tokens=10, last_logits=_logits(), messages=MESSAGES)
    with safe_open(str(w.path), framework="numpy") as f:
        assert set(f.keys()) == {"tokens", "block.000000", "block.000001", "block.000002", "last_logits"}
        tokens = f.get_tensor("tokens")
        assert tokens.dtype == np.int32 and tokens.tolist() == w.tokens
        for i, block in enumerate(w.blocks):
            data = f.get_tensor(block_name(i))
            assert data.dtype == np.uint8 and data.tobytes() == block.stored
        assert f.get_tensor("last_logits").tobytes() == _logits().tobytes()
        meta = json.loads(f.metadata()["kvsnap"])
    assert meta["format_version"] == FORMAT_VERSION
    assert meta["hash_scheme"] == hashing.HASH_SCHEME
    assert meta["layout"]["order"] == "layers,kv,kv_heads,tokens,head_dim"
    assert meta["messages"] == MESSAGES
    assert _data_start_is_aligned(w.path)


def _data_start_is_aligned(path: Path) -> bool:
    _, data_start = read_header(path)
    return data_start % 8 == 0


def test_block_names_sort_in_block_order():
    assert block_name(0) == "block.000000"
    assert block_name(50) == "block.000050"
    assert sorted(block_name(i) for i in (10, 9, 100)) == [block_name(9), block_name(10), block_name(100)]


def test_read_raw_in_any_order_and_with_one_or_many_workers(tmp_path):
    w = write_test_snapshot(tmp_path / "s.kv", num_tokens=40)
    with Snapshot(w.path) as snap:
        order = [7, 2, 9, 0]
        for workers in (1, 4):
            assert [bytes(b) for b in snap.read_raw(order, workers=workers)] == [w.raws[i] for i in order]
        assert snap.read_raw([]) == []


def test_stored_blocks_are_reused_as_is(tmp_path):
    """Blocks read back with read_into are written again without re-encoding, byte for byte."""
    w = write_test_snapshot(tmp_path / "a.kv", num_tokens=10, last_logits=_logits())
    raws = [b""] * 3
    with Snapshot(w.path) as snap:
        stored = snap.read_into([0, 1, 2], lambda i, raw: raws.__setitem__(i, raw.tobytes()))
        blocks = [snap.encoded_block(i, s) for i, s in enumerate(stored)]
        meta = snap.meta
    assert blocks == w.blocks
    write_snapshot(
        tmp_path / "b.kv",
        SnapshotHeader(
            model=meta.model,
            fingerprint=meta.fingerprint,
            root=meta.root,
            layout=meta.layout,
            block_size=meta.block_size,
            codec=meta.codec,
            level=meta.level,
        ),
        w.tokens,
        blocks,
        last_logits=_logits(),
    )
    assert read_everything(tmp_path / "b.kv")["blocks"] == w.raws == [bytes(r) for r in raws]


def test_blocks_must_cover_the_tokens(tmp_path):
    w = write_test_snapshot(tmp_path / "s.kv", num_tokens=8)
    with pytest.raises(ValueError):
        write_snapshot(
            tmp_path / "t.kv",
            SnapshotHeader(
                model=MODEL,
                fingerprint=FINGERPRINT,
                root=w.root,
                layout=w.layout,
                block_size=4,
                codec="shuffle-zstd",
                level=1,
            ),
            w.tokens + [1],
            w.blocks,
        )
    assert not (tmp_path / "t.kv").exists()


def test_verify_a_sound_file(tmp_path):
    w = write_test_snapshot(tmp_path / "s.kv", num_tokens=10, last_logits=_logits())
    with Snapshot(w.path) as snap:
        assert snap.verify() == []


def test_closed_snapshot_raises_snapshot_error(tmp_path):
    """Guards last_logits() on a closed snapshot escaping as AttributeError."""
    w = write_test_snapshot(tmp_path / "s.kv", num_tokens=10, last_logits=_logits())
    snap = Snapshot(w.path)
    snap.close()
    with pytest.raises(SnapshotError, match="snapshot is closed"):
        snap.read_raw([0])
    with pytest.raises(SnapshotError, match="snapshot is closed"):
        snap.last_logits()


# ---------------------------------------------------------------------------------------------
# Lazy reads


def _hundred_blocks(tmp_path: Path):
    layout = make_layout("float32", layers=1, kv_heads=1, head_dim=8)
    return write_test_snapshot(tmp_path / "big.kv", num_tokens=400, layout=layout, last_logits=_logits())


def test_damage_in_one_block_does_not_stop_reading_the_others(tmp_path):
    w = _hundred_blocks(tmp_path)
    assert len(w.blocks) == 100
    start, end = tensor_span(w.path, block_name(50))
    data = bytearray(w.path.read_bytes())
    data[(start + end) // 2] ^= 0x5A
    w.path.write_bytes(bytes(data))

    with Snapshot(w.path) as snap:
        assert snap.tokens == w.tokens
        assert [bytes(b) for b in snap.read_raw([0, 1])] == w.raws[:2]
        assert [bytes(b) for b in snap.read_raw(range(51, 100))] == w.raws[51:]
        with pytest.raises(SnapshotError, match=r"block 50\b") as excinfo:
            snap.read_raw(range(100))
        assert_one_line(excinfo.value)
        problems = snap.verify()
    assert len(problems) == 1 and "block 50" in problems[0]


def test_a_failed_read_leaves_no_worker_writing_after_it_returns(tmp_path, monkeypatch):
    """A restore that fails is followed by a recompute: no decode thread may still be writing
    into the failed restore's buffers once ``read_into`` has raised.

    Ordered by events, not by sleeps: block 3 fails only once block 4's sink is running, and every
    sink that starts holds on until the read is past its failure (the pool waits for what still
    runs): those sinks are running then, and must all have finished before ``read_into`` raises."""
    import threading

    from kvsnap.format import pool

    w = _hundred_blocks(tmp_path)
    start, end = tensor_span(w.path, block_name(3))
    data = bytearray(w.path.read_bytes())
    data[(start + end) // 2] ^= 0x5A
    w.path.write_bytes(bytes(data))
    started: set[int] = set()
    done: list[int] = []
    late: list[int] = []  # sinks that were still running after read_into returned
    lock = threading.Lock()
    four_running, past_failure, returned = threading.Event(), threading.Event(), threading.Event()
    real_read_stored, real_wait = Snapshot.read_stored, pool.wait

    def read_stored(self, index):
        with lock:
            started.add(index)
        if index == 3:
            assert four_running.wait(30), "block 4 never started"
        return real_read_stored(self, index)

    def waiting(futures):  # the pool, past the failure: what had not started is cancelled, the rest waited for
        past_failure.set()
        return real_wait(futures)

    def sink(index: int, raw) -> None:
        if index == 4:
            four_running.set()
        if index > 3:
            past_failure.wait(30)
        with lock:
            done.append(index)
            if returned.is_set():
                late.append(index)

    monkeypatch.setattr(Snapshot, "read_stored", read_stored)
    monkeypatch.setattr(pool, "wait", waiting)
    with Snapshot(w.path) as snap:
        with pytest.raises(SnapshotError, match=r"block 3\b"):
            snap.read_into(range(100), sink, workers=4)
        returned.set()
        landed = sorted(done)
    assert past_failure.is_set() and 4 in landed  # block 4 was still in its sink when block 3 failed
    assert landed == sorted(started - {3}) and late == []  # every sink begun had finished, none came after
    assert len(started) < 99  # and the blocks not yet started were cancelled


def test_read_raw_touches_only_the_blocks_asked_for(tmp_path, monkeypatch):
    w = _hundred_blocks(tmp_path)
    read_indices: list[int] = []
    decoded_sizes: list[int] = []
    original_read_stored = Snapshot.read_stored
    original_decode = codecs.decode

    def counting_read_stored(self, index):
        read_indices.append(index)
        return original_read_stored(self, index)

    def counting_decode(stored, raw_size, itemsize, codec, out=None, dtype=None):
        decoded_sizes.append(raw_size)
        return original_decode(stored, raw_size, itemsize, codec, out, dtype)

    monkeypatch.setattr(Snapshot, "read_stored", counting_read_stored)
    monkeypatch.setattr(codecs, "decode", counting_decode)

    fetched: list[str] = []
    original_view = Snapshot._view

    def spying_view(self, name):
        fetched.append(name)
        return original_view(self, name)

    with Snapshot(w.path) as snap:
        assert read_indices == [] and decoded_sizes == []  # opening reads no block
        monkeypatch.setattr(Snapshot, "_view", spying_view)
        assert [bytes(b) for b in snap.read_raw([0, 1])] == w.raws[:2]

    assert sorted(read_indices) == [0, 1]
    assert len(decoded_sizes) == 2
    assert sorted(fetched) == [block_name(0), block_name(1)]


# ---------------------------------------------------------------------------------------------
# Exhaustive damage


def _small_snapshot(tmp_path: Path):
    layout = make_layout("float32", layers=1, kv_heads=1, head_dim=2)
    return write_test_snapshot(
        tmp_path / "orig.kv",
        num_tokens=10,  # blocks of 4, 4 and a partial tail of 2
        layout=layout,
        last_logits=np.array([1.5, -2.0, 0.25, 3.0], dtype=np.float32),
        messages=[{"role": "user", "content": "hi 🦙"}],
        fingerprint="fp",
    )


def _check_damaged(path: Path, reference: dict, failures: list[str], label: str) -> None:
    try:
        got = read_everything(path)
    except SnapshotError as exc:
        if "\n" in str(exc) or not str(exc):
            failures.append(f"{label}: message is not one line: {str(exc)!r}")
        return
    except Exception as exc:  # any other type escaping is the failure looked for
        failures.append(f"{label}: {type(exc).__name__}: {exc}")
        return
    if got != reference:
        failures.append(f"{label}: read different data without an error")


def test_every_single_byte_flip_is_caught_or_harmless(tmp_path):
    """Every byte of a small file flipped, one at a time: identical data or SnapshotError, nothing else."""
    w = _small_snapshot(tmp_path)
    original = w.path.read_bytes()
    reference = read_everything(w.path)
    assert 300 <= len(original) <= 2500
    damaged = tmp_path / "damaged.kv"
    failures: list[str] = []
    tried = 0
    for mask in (0xFF, 0x01):
        for pos in range(len(original)):
            data = bytearray(original)
            data[pos] ^= mask
            damaged.write_bytes(bytes(data))
            _check_damaged(damaged, reference, failures, f"byte {pos} ^ {mask:#x}")
            tried += 1
    assert not failures, f"{len(failures)} of {tried} flips misbehaved, e.g. {failures[:5]}"


def test_every_truncation_is_caught(tmp_path):
    w = _small_snapshot(tmp_path)
    original = w.path.read_bytes()
    damaged = tmp_path / "damaged.kv"
    failures: list[str] = []
    for length in range(len(original)):
        damaged.write_bytes(original[:length])
        try:
            read_everything(damaged)
        except SnapshotError as exc:
            if "\n" in str(exc):
                failures.append(f"length {length}: message is not one line")
            continue
        except Exception as exc:
            failures.append(f"length {length}: {type(exc).__name__}: {exc}")
            continue
        failures.append(f"length {length}: truncated file read without an error")
    assert not failures, failures[:5]


def test_appended_bytes_are_refused(tmp_path):
    w = _small_snapshot(tmp_path)
    w.path.write_bytes(w.path.read_bytes() + b"\x00" * 8)
    with pytest.raises(SnapshotError):
        read_everything(w.path)


# ---------------------------------------------------------------------------------------------
# Errors: versions, foreign files, edited headers


def test_newer_format_version_raises_version_error(tmp_path):
    w = write_test_snapshot(tmp_path / "s.kv")
    rewrite_meta(w.path, lambda m: m.update(format_version=99))
    with pytest.raises(SnapshotVersionError) as excinfo:
        Snapshot(w.path)
    reason = str(excinfo.value).replace(str(w.path), "")  # the test's folder name holds "newer" too
    assert "newer" in reason and "99" in reason
    assert_one_line(excinfo.value)


def test_older_unknown_format_version_raises_version_error(tmp_path):
    w = write_test_snapshot(tmp_path / "s.kv")
    rewrite_meta(w.path, lambda m: m.update(format_version=0))
    with pytest.raises(SnapshotVersionError) as excinfo:
        Snapshot(w.path)
    assert "newer" not in str(excinfo.value).replace(str(w.path), "")
    assert_one_line(excinfo.value)


def test_rewrite_helper_keeps_a_file_readable(tmp_path):
    """The header-editing helper itself must not break a file, or the tests below prove nothing."""
    w = write_test_snapshot(tmp_path / "s.kv", last_logits=_logits(), messages=MESSAGES)
    before = read_everything(w.path)
    rewrite_meta(w.path, lambda m: None)
    assert read_everything(w.path) == before


def test_non_kvsnap_safetensors_file(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"weight": np.zeros((2, 3), dtype=np.float32)}, str(path))
    with pytest.raises(SnapshotError, match="not a kvsnap snapshot") as excinfo:
        Snapshot(path)
    assert_one_line(excinfo.value)
    save_file({"weight": np.zeros(3, dtype=np.float32)}, str(path), metadata={"format": "pt"})
    with pytest.raises(SnapshotError, match="not a kvsnap snapshot"):
        Snapshot(path)


@pytest.mark.parametrize(
    "content",
    [b"", b"abc", b"not a safetensors file at all, just text\n" * 10, b"\xff" * 64, bytes(64)],
)
def test_not_a_safetensors_file(tmp_path, content):
    path = tmp_path / "junk.kv"
    path.write_bytes(content)
    with pytest.raises(SnapshotError) as excinfo:
        Snapshot(path)
    assert_one_line(excinfo.value)


def test_missing_file(tmp_path):
    with pytest.raises(SnapshotError, match="no such file") as excinfo:
        Snapshot(tmp_path / "nope.kv")
    assert_one_line(excinfo.value)


def test_a_folder_is_not_a_snapshot(tmp_path):
    with pytest.raises(SnapshotError) as excinfo:
        Snapshot(tmp_path)
    assert_one_line(excinfo.value)


def test_snapshot_errors_are_kvsnap_errors():
    """The CLI catches only KvsnapError: every snapshot error must be one."""
    for cls in (SnapshotError, SnapshotVersionError, ForeignSnapshotError):
        assert issubclass(cls, KvsnapError)
    assert issubclass(SnapshotVersionError, SnapshotError) and issubclass(ForeignSnapshotError, SnapshotError)


def _set_block(i, key, value):
    return lambda m: m["blocks"][i].__setitem__(key, value)


def _other_root(m):
    m["root"] = hashing.chain_root("another-model", NAMESPACE, 4).hex()


EDITS = {
    "format_version missing": lambda m: m.pop("format_version"),
    "format_version a string": lambda m: m.update(format_version="1"),
    "format_version a bool": lambda m: m.update(format_version=True),
    "hash scheme": lambda m: m.update(hash_scheme="md5/int64"),
    "codec": lambda m: m.update(codec="lz4"),
    "level": lambda m: m.update(level=99),
    "dtype": lambda m: m["layout"].update(dtype="int4"),
    "layers 0": lambda m: m["layout"].update(layers=0),
    "layers huge": lambda m: m["layout"].update(layers=1 << 40),
    "layers a float": lambda m: m["layout"].update(layers=2.0),
    "layout missing": lambda m: m.pop("layout"),
    "layout a list": lambda m: m.update(layout=[2, 2, 4]),
    "block_size 0": lambda m: m.update(block_size=0),
    "block_size changed": lambda m: m.update(block_size=5),
    "num_tokens absurd": lambda m: m.update(num_tokens=1 << 40),
    "num_tokens negative": lambda m: m.update(num_tokens=-1),
    "num_tokens off by one": lambda m: m.update(num_tokens=m["num_tokens"] - 1),
    "blocks not a list": lambda m: m.update(blocks="x"),
    "block missing": lambda m: m.update(blocks=m["blocks"][:-1]),
    "block not an object": lambda m: m["blocks"].__setitem__(0, [1, 2]),
    "block tokens": _set_block(0, "tokens", 3),
    "block tokens a string": _set_block(0, "tokens", "4"),
    "raw_bytes absurd": _set_block(0, "raw_bytes", 1 << 50),
    "raw_bytes off": _set_block(0, "raw_bytes", 8),
    "stored_bytes absurd": _set_block(0, "stored_bytes", 1 << 40),
    "stored_bytes off": lambda m: m["blocks"][0].update(stored_bytes=m["blocks"][0]["stored_bytes"] + 1),
    "hash of another chain": _set_block(0, "hash", "00" * 16),
    "hash not hex": _set_block(0, "hash", "zz" * 16),
    "hash short": _set_block(0, "hash", "00" * 8),
    "hash on the partial tail": _set_block(-1, "hash", "00" * 16),
    "hash missing on a full block": _set_block(0, "hash", None),
    "root of another model": _other_root,
    "root not hex": lambda m: m.update(root="xyz"),
    "tokens checksum": lambda m: m.update(tokens_checksum="0" * 16),
    "logits dropped from meta": lambda m: m.update(logits_checksum=None),
    "logits checksum not a string": lambda m: m.update(logits_checksum=5),
    "model not a string": lambda m: m.update(model=5),
    "fingerprint missing": lambda m: m.pop("fingerprint"),
    "messages not a list": lambda m: m.update(messages="hi"),
    "message without content": lambda m: m.update(messages=[{"role": "user"}]),
    "message content not a string": lambda m: m.update(messages=[{"role": "user", "content": 3}]),
    "extra not an object": lambda m: m.update(extra=[1]),
}


@pytest.mark.parametrize("edit", EDITS)
def test_edited_metadata_is_refused(tmp_path, edit):
    """A header edited consistently (checksum re-signed) must still be refused with a SnapshotError."""
    w = write_test_snapshot(tmp_path / "s.kv", num_tokens=10, last_logits=_logits(), messages=MESSAGES)
    rewrite_meta(w.path, EDITS[edit])
    with pytest.raises(SnapshotError) as excinfo:
        read_everything(w.path)
    assert_one_line(excinfo.value)


@pytest.mark.parametrize(
    "created_at",
    ["yesterday", None, 10**400, 1e308, [1], -5],
    ids=["text", "null", "huge-int", "1e308", "list", "negative"],
)
def test_odd_created_at_never_escapes_as_another_error(tmp_path, created_at):
    """Guards a non-SnapshotError (OverflowError from float(10**400)) escaping from open."""
    w = write_test_snapshot(tmp_path / "s.kv", num_tokens=6)
    rewrite_meta(w.path, lambda m: m.update(created_at=created_at))
    try:
        got = read_everything(w.path)
    except SnapshotError as exc:
        assert_one_line(exc)
    else:
        assert got["tokens"] == w.tokens and got["blocks"] == w.raws
        assert isinstance(got["meta"].created_at, float)


def test_block_stored_far_larger_than_raw_is_refused_on_open(tmp_path):
    """Decompression input is bounded by the metadata: a block stored > raw + 4096 bytes is absurd."""
    layout = make_layout("float32", layers=1, kv_heads=1, head_dim=2)
    root = hashing.chain_root(FINGERPRINT, NAMESPACE, 4)
    tokens = [1, 2, 3, 4]
    raw_bytes = 4 * layout.bytes_per_token
    stored = bytes(raw_bytes + 5000)
    block = EncodedBlock(4, hashing.chain_hashes(tokens, 4, root)[0], raw_bytes, stored, hashing.checksum(stored))
    path = tmp_path / "s.kv"
    write_snapshot(
        path,
        SnapshotHeader(
            model=MODEL, fingerprint=FINGERPRINT, root=root, layout=layout, block_size=4, codec="raw", level=0
        ),
        tokens,
        [block],
    )
    with pytest.raises(SnapshotError, match="stored_bytes") as excinfo:
        Snapshot(path)
    assert_one_line(excinfo.value)


@pytest.mark.parametrize("text", ["", "[]", "1", "{", '{"format_version": 1}', "[" * 100_000])
def test_metadata_that_is_not_a_kvsnap_object(tmp_path, text):
    w = write_test_snapshot(tmp_path / "s.kv")
    rewrite_meta_text(w.path, text)
    with pytest.raises(SnapshotError) as excinfo:
        Snapshot(w.path)
    assert_one_line(excinfo.value)


def test_metadata_with_a_stale_checksum_is_refused(tmp_path):
    """An edit to the metadata that does not re-sign it is caught by the metadata checksum."""
    w = write_test_snapshot(tmp_path / "s.kv")
    header, _ = read_header(w.path)
    text = header["__metadata__"]["kvsnap"].replace(f'"model":"{MODEL}"', '"model":"test/other-mode"')
    assert text != header["__metadata__"]["kvsnap"]
    rewrite_meta_text(w.path, text, fix_checksum=False)
    with pytest.raises(SnapshotError, match="checksum"):
        Snapshot(w.path)


def test_block_checksum_mismatch_is_found_on_read(tmp_path):
    w = write_test_snapshot(tmp_path / "s.kv", num_tokens=10)
    rewrite_meta(w.path, _set_block(1, "checksum", "0" * 16))
    with Snapshot(w.path) as snap:
        assert bytes(snap.read_raw([0])[0]) == w.raws[0]
        with pytest.raises(SnapshotError, match="block 1"):
            snap.read_raw([1])


def test_block_that_does_not_decode_is_reported_by_index(tmp_path):
    """Stored bytes that pass their checksum but are not valid codec output: SnapshotError naming the block."""
    w = write_test_snapshot(tmp_path / "s.kv", num_tokens=10)
    start, end = tensor_span(w.path, block_name(1))
    data = bytearray(w.path.read_bytes())
    data[start] ^= 0xFF  # the byte-plane header's element size
    w.path.write_bytes(bytes(data))
    rewrite_meta(w.path, _set_block(1, "checksum", hashing.checksum(bytes(data[start:end]))))
    with Snapshot(w.path) as snap:
        with pytest.raises(SnapshotError, match="block 1 does not decode") as excinfo:
            snap.read_raw([1])
        assert_one_line(excinfo.value)


# ---------------------------------------------------------------------------------------------
# check_compatible


def _compatible_args(w, **changes):
    args = {"model": MODEL, "fingerprint": FINGERPRINT, "root": w.root, "layout": w.layout}
    args.update(changes)
    return args


def test_check_compatible_accepts_the_same_model(tmp_path):
    w = write_test_snapshot(tmp_path / "s.kv")
    with Snapshot(w.path) as snap:
        snap.check_compatible(**_compatible_args(w))


@pytest.mark.parametrize(
    ("what", "changes"),
    [
        ("fingerprint", {"fingerprint": "fp-another-model"}),
        ("dtype", {"layout": make_layout("bfloat16")}),
        ("kv heads", {"layout": make_layout(kv_heads=3)}),
        ("layers", {"layout": make_layout(layers=30)}),
        ("namespace", {"root": hashing.chain_root(FINGERPRINT, "other-namespace", 4)}),
        ("block size", {"root": hashing.chain_root(FINGERPRINT, NAMESPACE, 16)}),
    ],
)
def test_check_compatible_refuses_a_foreign_snapshot(tmp_path, what, changes):
    w = write_test_snapshot(tmp_path / "s.kv")
    with Snapshot(w.path) as snap, pytest.raises(ForeignSnapshotError) as excinfo:
        snap.check_compatible(**_compatible_args(w, **changes))
    assert_one_line(excinfo.value)


# ---------------------------------------------------------------------------------------------
# Atomic writes


def _overwrite(path: Path):
    return write_test_snapshot(path, num_tokens=23, seed=42, last_logits=_logits(), messages=MESSAGES)


def _assert_only(folder: Path, names: list[str]) -> None:
    assert sorted(os.listdir(folder)) == sorted(names), "a temporary file was left behind"


@pytest.mark.parametrize("failing", ["os.replace", "os.fsync"])
def test_failed_overwrite_leaves_the_previous_snapshot(tmp_path, monkeypatch, failing):
    path = tmp_path / "s.kv"
    write_test_snapshot(path, num_tokens=10, last_logits=_logits())
    before_bytes = path.read_bytes()
    before = read_everything(path)

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, failing.split(".")[1], fail)
    with pytest.raises(OSError):
        _overwrite(path)
    monkeypatch.undo()

    assert path.read_bytes() == before_bytes
    assert read_everything(path) == before
    _assert_only(tmp_path, ["s.kv"])


class _FailingFile:
    """A file that accepts its first write and then fails: the disk filling up mid-save."""

    def __init__(self, inner):
        self.inner = inner
        self.writes = 0

    def write(self, data):
        self.writes += 1
        if self.writes > 1:
            raise OSError(28, "No space left on device")
        return self.inner.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.inner.close()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_write_failing_midway_leaves_the_previous_snapshot(tmp_path, monkeypatch):
    path = tmp_path / "s.kv"
    write_test_snapshot(path, num_tokens=10)
    before = read_everything(path)
    real_fdopen = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda *a, **k: _FailingFile(real_fdopen(*a, **k)))
    with pytest.raises(OSError):
        _overwrite(path)
    monkeypatch.undo()
    assert read_everything(path) == before
    _assert_only(tmp_path, ["s.kv"])


def test_interrupted_first_write_leaves_nothing(tmp_path, monkeypatch):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupt)
    with pytest.raises(KeyboardInterrupt):
        _overwrite(tmp_path / "s.kv")
    monkeypatch.undo()
    _assert_only(tmp_path, [])


def test_data_is_fsynced_before_the_rename(tmp_path, monkeypatch):
    """A rename before the data reach the disk can leave an empty file after a crash."""
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append("fsync")
        return real_fsync(fd)

    def replace(src, dst):
        events.append("replace")
        assert Path(src).parent == Path(dst).parent, "the temporary file must be in the target's folder"
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    write_test_snapshot(tmp_path / "s.kv", num_tokens=6)
    assert "replace" in events and "fsync" in events[: events.index("replace")]


def test_successful_overwrite_replaces_the_file(tmp_path):
    path = tmp_path / "s.kv"
    write_test_snapshot(path, num_tokens=10)
    w = _overwrite(path)
    got = read_everything(path)
    assert got["tokens"] == w.tokens and got["blocks"] == w.raws
    _assert_only(tmp_path, ["s.kv"])


def test_write_to_a_relative_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    w = write_test_snapshot(Path("rel.kv"), num_tokens=6)
    assert read_everything(tmp_path / "rel.kv")["blocks"] == w.raws
    _assert_only(tmp_path, ["rel.kv"])
