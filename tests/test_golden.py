"""Golden files: every future kvsnap must still read the committed format-1 ``.kv`` files.

tests/data/golden-v1*.kv were written once by tests/data/make_golden.py; tests/data/golden-v1.json
says what they decode to (computed from the generator's inputs, not by reading them back). If a
test here fails, the reader (or writer) broke compatibility with files users already have: fix
the code, do not regenerate the golden files.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zstandard
from safetensors import safe_open

from kvsnap import hashing
from kvsnap.format import Snapshot, block_name

DATA = Path(__file__).resolve().parent / "data"
GOLDEN = json.loads((DATA / "golden-v1.json").read_text(encoding="utf-8"))
FILES = sorted(GOLDEN["files"])
DO_NOT_REGENERATE = (
    "Do NOT regenerate the golden files to make this pass: they stand for snapshots users already have. "
    "If the format changed on purpose, bump FORMAT_VERSION, keep reading version 1, and add golden-v2 files."
)


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_golden", DATA / "make_golden.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generator():
    return _load_generator()


def test_both_golden_files_are_committed_and_small():
    assert FILES == ["golden-v1-bf16.kv", "golden-v1.kv"]
    for name in FILES:
        data = (DATA / name).read_bytes()
        assert len(data) < 50_000
        exp = GOLDEN["files"][name]
        assert len(data) == exp["file_bytes"]
        assert hashlib.sha256(data).hexdigest() == exp["file_sha256"], f"{name} is not the committed golden file"


@pytest.mark.parametrize("name", FILES)
def test_golden_file_reads_as_recorded(name):
    exp = GOLDEN["files"][name]
    with Snapshot(DATA / name) as snap:
        meta = snap.meta
        assert meta.format_version == exp["format_version"] == 1
        assert (meta.model, meta.fingerprint) == (exp["model"], exp["fingerprint"])
        assert meta.root.hex() == exp["root"]
        lay = exp["layout"]
        assert (meta.layout.num_layers, meta.layout.num_kv_heads, meta.layout.head_dim, meta.layout.dtype) == (
            lay["layers"],
            lay["kv_heads"],
            lay["head_dim"],
            lay["dtype"],
        )
        assert meta.layout.bytes_per_token == exp["bytes_per_token"]
        assert (meta.block_size, meta.codec, meta.level) == (exp["block_size"], exp["codec"], exp["level"])
        assert meta.created_at == exp["created_at"]
        assert meta.num_tokens == snap.num_tokens == exp["num_tokens"] == len(exp["tokens"])
        assert snap.tokens == exp["tokens"]
        assert meta.messages == (None if exp["messages"] is None else tuple(exp["messages"]))
        assert meta.extra == exp["extra"]

        assert [b.num_tokens for b in meta.blocks] == [b["tokens"] for b in exp["blocks"]]
        assert [b.hash.hex() if b.hash else None for b in meta.blocks] == [b["hash"] for b in exp["blocks"]]
        assert [b.raw_bytes for b in meta.blocks] == [b["raw_bytes"] for b in exp["blocks"]]
        assert meta.kv_bytes == sum(b["raw_bytes"] for b in exp["blocks"])
        assert meta.blocks[-1].hash is None and meta.blocks[-1].num_tokens < meta.block_size  # partial tail

        raws = snap.read_raw(range(len(meta.blocks)))
        assert [hashlib.sha256(bytes(r)).hexdigest() for r in raws] == [b["raw_sha256"] for b in exp["blocks"]]

        logits = snap.last_logits()
        if exp["last_logits"] is None:
            assert logits is None
        else:
            assert logits is not None and logits.dtype == np.float32
            assert hashlib.sha256(logits.tobytes()).hexdigest() == exp["last_logits_sha256"]
            want = np.array([float(x) for x in exp["last_logits"]], dtype=np.float32)
            assert logits.tobytes() == want.tobytes()  # bit for bit: -inf, -0.0 and the subnormal too

        assert snap.verify() == []


@pytest.mark.parametrize("name", FILES)
def test_golden_file_reads_block_by_block_and_through_a_sink(name):
    """The lazy paths a resume takes (one block at a time, decode into a sink) see the same bytes."""
    exp = GOLDEN["files"][name]
    want = [b["raw_sha256"] for b in exp["blocks"]]
    with Snapshot(DATA / name) as snap:
        for i in reversed(range(len(want))):
            assert hashlib.sha256(bytes(snap.read_raw([i])[0])).hexdigest() == want[i]
        got: dict[int, str] = {}

        def sink(index: int, raw: np.ndarray) -> None:
            got[index] = hashlib.sha256(raw.tobytes()).hexdigest()

        snap.read_into(range(len(want)), sink, workers=2)
    assert [got[i] for i in range(len(want))] == want


@pytest.mark.parametrize("name", FILES)
def test_golden_hashes_are_the_chain_of_the_tokens(name):
    """The chained block hash is part of the format: the same tokens must hash the same forever."""
    exp = GOLDEN["files"][name]
    root = hashing.chain_root(exp["fingerprint"], exp["namespace"], exp["block_size"])
    assert root.hex() == exp["root"]
    hashes = hashing.chain_hashes(exp["tokens"], exp["block_size"], root)
    assert [h.hex() for h in hashes] == [b["hash"] for b in exp["blocks"] if b["hash"] is not None]


@pytest.mark.parametrize("name", FILES)
def test_golden_file_is_a_plain_safetensors_file(name):
    exp = GOLDEN["files"][name]
    with safe_open(str(DATA / name), framework="numpy") as f:
        names = {"tokens", *(block_name(i) for i in range(len(exp["blocks"])))}
        if exp["last_logits"] is not None:
            names.add("last_logits")
        assert set(f.keys()) == names
        assert f.get_tensor("tokens").tolist() == exp["tokens"]
        meta = json.loads(f.metadata()["kvsnap"])
    assert meta["format_version"] == 1
    assert meta["hash_scheme"] == hashing.HASH_SCHEME


@pytest.mark.parametrize("name", FILES)
def test_golden_json_is_what_the_generator_records(name, generator):
    """golden-v1.json was written by make_golden.py from its inputs, not edited by hand."""
    data = (DATA / name).read_bytes()
    assert generator.expected(name, data) == GOLDEN["files"][name]


def _parts(data: bytes) -> tuple[dict[str, Any], dict[str, Any], dict[str, bytes]]:
    """(header without metadata, kvsnap metadata, tensor bytes by name) of a snapshot file."""
    (n,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8 : 8 + n])
    meta = json.loads(header.pop("__metadata__")["kvsnap"])
    body = data[8 + n :]
    tensors = {k: body[v["data_offsets"][0] : v["data_offsets"][1]] for k, v in header.items()}
    return header, meta, tensors


@pytest.mark.parametrize("name", FILES)
def test_writer_output_is_byte_stable(name, generator):
    """Writing the same inputs today gives the committed bytes: the writer's format did not drift."""
    committed = (DATA / name).read_bytes()
    rebuilt = generator.build(name)
    if rebuilt == committed:
        return
    # Tell a format change from a new zstd library compressing the same bytes differently.
    old_h, old_meta, old_t = _parts(committed)
    new_h, new_meta, new_t = _parts(rebuilt)
    zstd_now, zstd_then = list(zstandard.ZSTD_VERSION), GOLDEN["zstd_version"]
    blocks_only = (
        zstd_now != zstd_then
        and set(old_t) == set(new_t)
        and all(old_t[k] == new_t[k] for k in old_t if not k.startswith("block."))
        and [{**b, "stored_bytes": 0, "checksum": ""} for b in old_meta["blocks"]]
        == [{**b, "stored_bytes": 0, "checksum": ""} for b in new_meta["blocks"]]
        and {k: v for k, v in old_meta.items() if k != "blocks"} == {k: v for k, v in new_meta.items() if k != "blocks"}
    )
    if blocks_only:
        pytest.skip(
            f"{name}: only the compressed block bytes differ, made by zstd {zstd_now} (golden: zstd {zstd_then}); "
            "the committed file still has to read correctly (the other tests check that)"
        )
    changed = sorted(k for k in set(old_meta) | set(new_meta) if old_meta.get(k) != new_meta.get(k))
    pytest.fail(
        f"The writer's output changed: rebuilding {name} gives {len(rebuilt)} bytes, the committed file has "
        f"{len(committed)} (metadata fields that differ: {changed or 'none'}; tensor header equal: {old_h == new_h}). "
        + DO_NOT_REGENERATE
    )
