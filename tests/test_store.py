"""The block store: leaf-only LRU under a budget, pins, dedup, collisions, namespaces, damage, two writers, .kv files.

The property test drives a real ``BlockStore`` (files, lock, JSON index) through random
insert/lookup/fetch/pin/unpin/budget sequences next to a plain reference model, and checks after
every step that the budget holds, nothing evicted had a stored child or a pin, the least recently
used leaf went first, and every lookup's blocks hold the prompt's tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest
from core_helpers import FINGERPRINT, MODEL, NAMESPACE, make_layout, read_everything, write_test_snapshot
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvsnap import hashing
from kvsnap.errors import ConfigError, KvsnapError, SnapshotError
from kvsnap.format import encode_block
from kvsnap.format import meta as snapshot_meta
from kvsnap.hashing import checksum
from kvsnap.store import BlockStore, ChainInfo, StoreError, block_keys, interchange
from kvsnap.store.index_json import index_from_json
from kvsnap.types import EncodedBlock
from kvsnap_cli.sizes import parse_size

ROOT_DIR = Path(__file__).resolve().parents[1]


def make_chain(
    namespace: str = NAMESPACE, block_size: int = 4, layout=None, fingerprint: str = FINGERPRINT
) -> ChainInfo:
    layout = layout or make_layout(layers=1, kv_heads=1, head_dim=2)  # 8 bytes a token
    return ChainInfo(hashing.chain_root(fingerprint, namespace, block_size), MODEL, fingerprint, layout, block_size)


def fake_raw(chain: ChainInfo, tokens: list[int], start: int) -> bytes:
    """KV-like bytes of a block: a function of its position and tokens, so a wrong block reads wrong."""
    n = len(tokens) * chain.layout.bytes_per_token // 4
    seed = int.from_bytes(hashlib.blake2b(repr((start, tokens)).encode(), digest_size=4).digest(), "little")
    return np.random.default_rng(seed).standard_normal(n).astype("<f4").tobytes()


def make_blocks(chain: ChainInfo, tokens: list[int], codec: str = "raw") -> list[EncodedBlock]:
    bs = chain.block_size
    hashes = hashing.chain_hashes(tokens, bs, chain.root)
    blocks = []
    for i, start in enumerate(range(0, len(tokens), bs)):
        part = tokens[start : start + bs]
        h = hashes[i] if i < len(hashes) else None
        blocks.append(encode_block(fake_raw(chain, part, start), len(part), h, chain.layout.itemsize, codec, 1))
    return blocks


def put(store: BlockStore, chain: ChainInfo, tokens: list[int], name: str | None = None, codec: str = "raw", **kw):
    """Store ``tokens`` with fake KV: as session ``name``, or as anonymous cache blocks."""
    blocks = make_blocks(chain, tokens, codec)
    if name is None:
        return store.put(chain, tokens, blocks, codec=codec)
    return store.add_session(name, chain, tokens, blocks, codec=codec, **kw)


def assert_consistent(path: Path) -> dict:
    """The store as another reader finds it, checked without the store's own code."""
    data = json.loads((path / "index.json").read_text())
    roots = {c["root"] for c in data["chains"]}
    hashes = {b["hash"] for b in data["blocks"]}
    for b in data["blocks"]:
        file = path / "blocks" / b["hash"][:2] / f"{b['hash']}.blk"
        # A block file: its stored bytes, then a trailer naming the block (JSON, its u32 length, a magic).
        raw = file.read_bytes()
        assert raw[-8:] == b"\x00kvsblk1", b["hash"]
        (length,) = struct.unpack("<I", raw[-12:-8])
        trailer, stored = json.loads(raw[-12 - length : -12]), raw[: -12 - length]
        assert {k: trailer[k] for k in b if k != "last_use"} == {k: v for k, v in b.items() if k != "last_use"}
        assert len(stored) == b["stored_bytes"] and checksum(stored) == b["checksum"], b["hash"]
        assert b["parent"] in hashes or (b["parent"] == b["root"] and b["root"] in roots), b["hash"]
    assert index_from_json(data).check() == []
    return data


# ---------------------------------------------------------------------------------------------
# Property test: random operation sequences against a reference model

BS = 2
CHAINS = [
    make_chain("alice", BS),
    make_chain("bob", BS, layout=make_layout(layers=1, kv_heads=1, head_dim=6)),  # 24 bytes a token
]
NAMES = ["s0", "s1", "s2"]
PROMPTS = st.lists(st.integers(0, 2), max_size=9)


# The state machine's stores: in memory (tmpfs) where there is one. It checks eviction and what the
# folder holds, not durability (test_store_faults.py and test_reliability.py break writes and kill
# writers); its ~3,000 operations each fsync several files, which on a busy disk took minutes.
_MACHINE_TMP = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class StoreMachine(RuleBasedStateMachine):
    """A real store next to a model of what leaf-only LRU must leave in it."""

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="kvsnap-store-test-", dir=_MACHINE_TMP))
        self.store: BlockStore | None = None
        self.budget = 0
        self.blocks: dict[bytes, tuple[bytes, int]] = {}  # hash -> (parent, stored bytes)
        self.recency: dict[bytes, int] = {}
        self.tick = 0
        self.sessions: dict[str, tuple[tuple[bytes, ...], bool]] = {}  # name -> (hashes, pinned)

    # -- the model ---------------------------------------------------------------------------

    def touch(self, h: bytes) -> None:
        self.tick += 1
        self.recency[h] = self.tick

    def pinned(self, h: bytes) -> bool:
        return any(p and h in hashes for hashes, p in self.sessions.values())

    def model_evict(self) -> list[bytes]:
        evicted = []
        while sum(size for _, size in self.blocks.values()) > self.budget:
            parents = {parent for parent, _ in self.blocks.values()}
            leaves = [h for h in self.blocks if h not in parents and not self.pinned(h)]
            if not leaves:
                break
            victim = min(leaves, key=self.recency.__getitem__)
            del self.blocks[victim]
            evicted.append(victim)
        return evicted

    def check_evicted(self, evicted: tuple[bytes, ...] | list[bytes], expected: list[bytes]) -> None:
        # The least recently used evictable leaf first, every time: the same blocks in the same order.
        assert list(evicted) == expected
        for h in evicted:
            assert not self.pinned(h), "evicted a pinned block"
            assert all(parent != h for parent, _ in self.blocks.values()), "evicted a block with a stored child"

    # -- rules -------------------------------------------------------------------------------

    @initialize(budget=st.integers(0, 300))
    def open_store(self, budget: int) -> None:
        self.budget = budget
        self.store = BlockStore(self.tmp, budget)

    @rule(chain=st.sampled_from(CHAINS), prompt=PROMPTS, name=st.sampled_from([None, *NAMES]), pin=st.booleans())
    def insert(self, chain: ChainInfo, prompt: list[int], name: str | None, pin: bool) -> None:
        if name is not None and not prompt:
            return
        result = put(self.store, chain, prompt, name, pin=pin) if name else put(self.store, chain, prompt)
        keys = block_keys(prompt, BS, chain.root)
        if name is None:
            keys = keys[: len(prompt) // BS]
        parent = chain.root
        for i, h in enumerate(keys):
            size = len(prompt[i * BS : (i + 1) * BS]) * chain.layout.bytes_per_token
            self.blocks.setdefault(h, (parent, size))
            self.touch(h)
            parent = h
        if name is not None:
            self.sessions[name] = (tuple(keys), pin)
        self.check_evicted(result.evicted, self.model_evict())

    @rule(chain=st.sampled_from(CHAINS), prompt=PROMPTS, fetch=st.booleans())
    def lookup(self, chain: ChainInfo, prompt: list[int], fetch: bool) -> None:
        if fetch:
            match, blocks = self.store.fetch(prompt, chain.root, BS)
            for i, block in enumerate(blocks):
                part = prompt[i * BS : (i + 1) * BS]
                assert bytes(block.decode(chain.layout.itemsize)) == fake_raw(chain, part, i * BS)
        else:
            match = self.store.lookup(prompt, chain.root, BS)
        expected = []
        for h in hashing.chain_hashes(prompt, BS, chain.root):
            if h not in self.blocks:
                break
            expected.append(h)
            self.touch(h)
        assert list(match.hashes) == expected
        assert match.hit_tokens == BS * len(expected)
        index = self.store.read_index()
        for i, h in enumerate(match.hashes):
            assert list(index.blocks[h].token_ids) == prompt[i * BS : (i + 1) * BS]

    @rule(name=st.sampled_from(NAMES), pin=st.booleans())
    def pin_or_unpin(self, name: str, pin: bool) -> None:
        if name not in self.sessions:
            with pytest.raises(StoreError):
                self.store.pin(name) if pin else self.store.unpin(name)
            return
        hashes, _ = self.sessions[name]
        self.sessions[name] = (hashes, pin)
        if pin:
            self.store.pin(name)
        else:
            self.check_evicted(self.store.unpin(name), self.model_evict())

    @rule(budget=st.integers(0, 300))
    def set_budget(self, budget: int) -> None:
        self.budget = budget
        self.check_evicted(self.store.set_budget(budget), self.model_evict())

    @rule()
    def evict(self) -> None:
        self.check_evicted(self.store.evict_to_budget(), self.model_evict())

    # -- after every step --------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        if self.store is None:
            return
        index = self.store.read_index()
        assert set(index.blocks) == set(self.blocks)
        assert index.check() == []
        assert len(list(self.tmp.glob("blocks/*/*.blk"))) == len(index.blocks)  # evicted files are gone
        # The budget holds, unless every block left is one eviction may not take.
        assert index.num_bytes <= self.budget or not any(index.evictable(h) for h in index.blocks)
        assert index.stats()["budget_bytes"] == self.budget

    def teardown(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


TestLeafOnlyLRU = StoreMachine.TestCase
TestLeafOnlyLRU.settings = settings(
    derandomize=True,
    deadline=None,
    max_examples=100,
    stateful_step_count=30,
    suppress_health_check=[HealthCheck.too_slow],
)


# ---------------------------------------------------------------------------------------------
# Eviction by example: the seed's situation


def test_shared_system_prompt_survives_churn(tmp_path):
    """The shared prefix is an inner node with many children: never a candidate, even as the oldest block."""
    chain = make_chain()
    system = list(range(100, 112))  # 3 blocks
    block = 4 * chain.layout.bytes_per_token
    store = BlockStore(tmp_path, budget_bytes=5 * block)
    sys_hashes = hashing.chain_hashes(system, 4, chain.root)
    put(store, chain, system)
    for user in range(10):
        put(store, chain, system + [user] * 4)
        assert all(h in store.read_index().blocks for h in sys_hashes)
        assert store.stats()["bytes"] <= 5 * block
    # Only the two most recent questions fit beside the system prompt.
    match = store.lookup(system + [9] * 4, chain.root, 4)
    assert match.hit_tokens == 16
    assert store.lookup(system + [0] * 4, chain.root, 4).hit_tokens == 12


def test_pinned_session_is_kept_and_unpin_lets_it_go(tmp_path):
    chain = make_chain()
    block = 4 * chain.layout.bytes_per_token
    store = BlockStore(tmp_path, budget_bytes=4 * block)
    keep = list(range(16))
    put(store, chain, keep, "keep", pin=True)
    for i in range(5):
        put(store, chain, [1000 + i] * 8)
    assert store.lookup(keep, chain.root, 4).hit_tokens == 16
    stats = store.stats()
    assert stats["pinned_sessions"] == 1 and stats["bytes"] == 4 * block
    # Pins outweigh the budget: the store stays over it rather than drop a pinned block.
    store.set_budget(block)
    assert store.stats()["bytes"] == 4 * block
    evicted = store.unpin("keep")
    assert len(evicted) == 3 and store.stats()["bytes"] == block
    # Leaves first: what is left is the session's first block.
    assert store.lookup(keep, chain.root, 4).hit_tokens == 4


def test_pins_are_reference_counted(tmp_path):
    chain = make_chain()
    store = BlockStore(tmp_path)
    shared = list(range(8))
    put(store, chain, shared + [1, 1, 1, 1], "a", pin=True)
    put(store, chain, shared + [2, 2, 2, 2], "b", pin=True)
    store.unpin("a")
    store.set_budget(0)
    index = store.read_index()
    # a's own leaf went; the shared blocks are still b's.
    assert store.lookup(shared + [2, 2, 2, 2], chain.root, 4).hit_tokens == 12
    assert len(index.blocks) == 3


def test_blocks_are_stored_once(tmp_path):
    chain = make_chain()
    store = BlockStore(tmp_path)
    system = list(range(12))
    put(store, chain, system + [1] * 4, "a")
    r = put(store, chain, system + [2] * 4 + [7], "b")
    assert (r.new_blocks, r.reused_blocks, r.stored_tokens) == (2, 3, 17)
    files = list((tmp_path / "blocks").rglob("*.blk"))
    assert len(files) == store.stats()["blocks"] == 6  # 3 shared + 2 leaves + b's partial tail
    # The radix view: the shared prefix once, the two branches below it.
    tree = store.tree()["roots"][0]["children"]
    assert len(tree) == 1 and tree[0]["blocks"] == 3 and tree[0]["token_ids"] == system
    a, b = tree[0]["children"]
    assert (a["sessions"], a["blocks"], a["partial"]) == (["a"], 1, False)
    assert (b["sessions"], b["blocks"], b["partial"], b["token_ids"]) == (["b"], 2, True, [2, 2, 2, 2, 7])


def test_budget_persists_and_stats_fields(tmp_path):
    BlockStore(tmp_path, budget_bytes=1234)
    stats = BlockStore(tmp_path, create=False).stats()
    for key in ("blocks", "bytes", "budget_bytes", "sessions", "hits", "evictions"):
        assert key in stats
    assert stats["budget_bytes"] == 1234
    with pytest.raises(StoreError):
        BlockStore(tmp_path / "nowhere", create=False)


# ---------------------------------------------------------------------------------------------
# Collisions and namespaces


def test_forced_hash_collision_never_reuses_wrong_kv(tmp_path, monkeypatch):
    """Block hashes that ignore the tokens: a lookup stops where the tokens differ, a put is refused."""
    monkeypatch.setattr(hashing, "block_hash", lambda parent, ids: hashlib.blake2b(parent, digest_size=16).digest())
    chain = make_chain()
    store = BlockStore(tmp_path)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    b = [1, 2, 3, 4, 9, 9, 9, 9]
    put(store, chain, a)
    assert hashing.chain_hashes(b, 4, chain.root) == hashing.chain_hashes(a, 4, chain.root)  # the collision is real
    assert store.lookup(b, chain.root, 4).hit_tokens == 4
    assert store.lookup([5, 6, 7, 8], chain.root, 4).hit_tokens == 0
    match, blocks = store.fetch(b, chain.root, 4)
    assert match.hit_tokens == 4 and [list(x.record.token_ids) for x in blocks] == [[1, 2, 3, 4]]
    with pytest.raises(StoreError, match="collision"):
        put(store, chain, b)
    # a's second block is untouched.
    h = hashing.chain_hashes(a, 4, chain.root)[1]
    assert store.get(h) == make_blocks(chain, a)[1].stored
    assert store.check() == []


def test_another_namespace_never_hits(tmp_path, monkeypatch):
    store = BlockStore(tmp_path)
    alice, bob = make_chain("alice"), make_chain("bob")
    tokens = list(range(16))
    put(store, alice, tokens, "alice-chat")
    assert store.lookup(tokens, alice.root, 4).hit_tokens == 16
    assert store.lookup(tokens, bob.root, 4).hit_tokens == 0
    # Even with a hash that ignores the chain (so both namespaces' blocks hash alike), roots stay apart.
    monkeypatch.setattr(hashing, "block_hash", lambda parent, ids: hashlib.blake2b(bytes(ids), digest_size=16).digest())
    put(store, alice, tokens)
    assert store.lookup(tokens, bob.root, 4).hit_tokens == 0
    assert store.lookup(tokens, alice.root, 4).hit_tokens == 16


def test_a_root_keeps_one_layout(tmp_path):
    store = BlockStore(tmp_path)
    chain = make_chain()
    put(store, chain, list(range(8)))
    other = ChainInfo(chain.root, MODEL, FINGERPRINT, make_layout(layers=3), 4)
    with pytest.raises(StoreError, match="chain root"):
        put(store, other, list(range(8)))


def test_wrong_blocks_are_refused(tmp_path):
    store = BlockStore(tmp_path)
    chain = make_chain()
    blocks = make_blocks(chain, list(range(8)))
    with pytest.raises(ValueError, match="hash"):
        store.put(chain, list(range(1, 9)), blocks, codec="raw")
    bad = EncodedBlock(4, blocks[0].hash, blocks[0].raw_bytes, b"x" * len(blocks[0].stored), blocks[0].checksum)
    with pytest.raises(StoreError, match="checksum"):
        store.put(chain, list(range(8)), [bad, blocks[1]], codec="raw")
    assert store.stats()["blocks"] == 0


# ---------------------------------------------------------------------------------------------
# Damage


def test_damaged_block_is_refused_and_not_used(tmp_path):
    chain = make_chain()
    store = BlockStore(tmp_path)
    tokens = list(range(16))
    put(store, chain, tokens, "s")
    hashes = hashing.chain_hashes(tokens, 4, chain.root)
    path = tmp_path / "blocks" / hashes[1].hex()[:2] / f"{hashes[1].hex()}.blk"
    data = bytearray(path.read_bytes())
    data[5] ^= 0x10
    path.write_bytes(bytes(data))

    with pytest.raises(StoreError, match="damaged"):
        store.get(hashes[1])
    with pytest.raises(StoreError):
        interchange.export_session(store, "s", tmp_path / "s.kv")
    match, blocks = store.fetch(tokens, chain.root, 4)
    assert match.hit_tokens == 4 and len(blocks) == 1
    # Dropped with everything below it; the store is sound again, and a put repairs it.
    assert set(store.read_index().blocks) == {hashes[0]}
    assert store.check() == [] and store.stats()["damaged"] == 1
    put(store, chain, tokens, "s")
    match, blocks = store.fetch(tokens, chain.root, 4)
    assert match.hit_tokens == 16
    assert [bytes(b.decode(4)) for b in blocks] == [fake_raw(chain, tokens[i : i + 4], i) for i in range(0, 16, 4)]


def test_gc_removes_leftovers_and_drops_missing_blocks(tmp_path):
    chain = make_chain()
    store = BlockStore(tmp_path)
    tokens = list(range(12))
    put(store, chain, tokens, "s")
    put(store, chain, [7] * 8, "gone")
    hashes = hashing.chain_hashes(tokens, 4, chain.root)
    (tmp_path / "blocks" / hashes[1].hex()[:2] / f"{hashes[1].hex()}.blk").unlink()
    stray = tmp_path / "blocks" / "ab" / ("ab" * 16 + ".blk")
    stray.parent.mkdir(exist_ok=True)
    stray.write_bytes(b"orphan")
    (tmp_path / "blocks" / "ab" / f".{'ab' * 16}.blk.12345678.tmp").write_bytes(b"half")  # a crashed block write
    (tmp_path / ".index.json.abcdefgh.tmp").write_bytes(b"half")
    for h in hashing.chain_hashes([7] * 8, 4, chain.root):
        (tmp_path / "blocks" / h.hex()[:2] / f"{h.hex()}.blk").unlink()
    assert store.check()

    report = store.gc()
    assert (report.temp_files, report.orphan_files, report.dropped_blocks) == (2, 1, 4)
    assert report.dropped_sessions == 1  # "gone" has nothing left; "s" keeps its first block
    assert set(store.read_index().blocks) == {hashes[0]}
    assert store.check() == []
    assert_consistent(tmp_path)


def test_a_failed_write_is_a_store_error_and_changes_nothing(tmp_path, monkeypatch):
    store = BlockStore(tmp_path)
    chain = make_chain()
    put(store, chain, list(range(8)), "s")
    before = (tmp_path / "index.json").read_bytes()

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("kvsnap.format.atomic.os.fsync", full)
    with pytest.raises(StoreError, match="No space left"):
        put(store, chain, list(range(16)), "t")
    monkeypatch.undo()
    assert (tmp_path / "index.json").read_bytes() == before
    assert store.check() == [] and not list(tmp_path.rglob("*.tmp"))


def test_damaged_index_is_a_store_error(tmp_path):
    store = BlockStore(tmp_path)
    put(store, make_chain(), list(range(8)))
    (tmp_path / "index.json").write_text('{"format": "kvsnap-store", "version": 1, "blocks": [')
    with pytest.raises(StoreError, match="not valid JSON"):
        store.stats()
    (tmp_path / "index.json").write_text('{"format": "kvsnap-store", "version": 99}')
    with pytest.raises(StoreError, match="version"):
        store.stats()


# ---------------------------------------------------------------------------------------------
# Two processes


WRITER = textwrap.dedent(
    """
    import json, random, sys
    sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
    from test_store import make_chain, put
    from kvsnap import hashing
    from kvsnap.store import BlockStore

    root_dir, path, seed, budget = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    store = BlockStore(path, None if budget == "none" else int(budget))
    chain = make_chain()
    rng = random.Random(seed)
    print("ready", flush=True)
    sys.stdin.readline()  # both writers start together: the test says go once both are ready
    inserted = []
    for i in range(40):
        tokens = list(range(8)) + [rng.randrange(3) for _ in range(rng.randrange(0, 14))]
        if i % 3 == 0:
            put(store, chain, tokens, f"p{seed}-{i}")
            inserted += [h.hex() for h in hashing.chain_hashes(tokens, 4, chain.root)]
        else:
            put(store, chain, tokens)
            inserted += [h.hex() for h in hashing.chain_hashes(tokens, 4, chain.root)]
        store.fetch(tokens[: rng.randrange(0, len(tokens) + 1)], chain.root, 4)
    print(json.dumps(inserted))
    """
)


@pytest.mark.parametrize("budget", [None, 300])
def test_two_processes_share_one_store(tmp_path, budget):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    store_dir = tmp_path / "store"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(ROOT_DIR), str(store_dir), str(seed), str(budget).lower()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2)
    ]
    for p in procs:  # a start barrier: each has imported and opened the store
        assert p.stdout.readline() == "ready\n", p.communicate(timeout=120)[1]
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    outputs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err
    data = assert_consistent(store_dir)
    store = BlockStore(store_dir)
    assert store.check() == []
    full = {b["hash"] for b in data["blocks"] if b["full"]}
    inserted = set().union(*(json.loads(out) for out, _ in outputs))
    assert len(list((store_dir / "blocks").rglob("*.blk"))) == len(data["blocks"])
    if budget is None:
        # No update was lost: every full block either process stored is there, once; every session too.
        assert full == inserted
        assert len(data["sessions"]) == 2 * 14
    else:
        assert full <= inserted
        assert store.stats()["bytes"] <= budget
    assert data["counters"]["lookups"] == 80


# ---------------------------------------------------------------------------------------------
# .kv interchange


@pytest.fixture
def fixed_clock(monkeypatch):
    """Snapshots record when they were written; a fixed clock makes two writes comparable byte for byte."""
    monkeypatch.setattr(snapshot_meta, "time", types.SimpleNamespace(time=lambda: 1700000000.0))


def test_export_import_export_is_bit_identical(tmp_path, fixed_clock):
    layout = make_layout("bfloat16", layers=2, kv_heads=2, head_dim=8)
    logits = np.random.default_rng(3).standard_normal(50).astype(np.float32)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    original = write_test_snapshot(
        tmp_path / "orig.kv", num_tokens=22, layout=layout, last_logits=logits, messages=messages, extra={"k": "v"}
    )
    first = BlockStore(tmp_path / "one")
    interchange.import_snapshot(first, original.path, pin=True)
    assert first.sessions()[0].name == "orig"
    size = interchange.export_session(first, "orig", tmp_path / "a.kv")

    second = BlockStore(tmp_path / "two")
    interchange.import_snapshot(second, tmp_path / "a.kv", "again")
    interchange.export_session(second, "again", tmp_path / "b.kv")

    a, b = (tmp_path / "a.kv").read_bytes(), (tmp_path / "b.kv").read_bytes()
    assert a == b and len(a) == size
    assert a == original.path.read_bytes()  # nothing lost on the way in either
    got = read_everything(tmp_path / "b.kv")
    assert got["blocks"] == original.raws and got["tokens"] == original.tokens
    assert got["logits"] == logits.tobytes() and list(got["meta"].messages) == messages


def test_export_reencodes_blocks_stored_with_another_codec(tmp_path, fixed_clock):
    chain = make_chain(layout=make_layout(layers=2, kv_heads=2, head_dim=4))
    store = BlockStore(tmp_path)
    system = list(range(8))
    put(store, chain, system + [1, 2], "first", codec="zstd")
    tokens = system + [3, 4, 5, 6, 7]
    store.add_session("second", chain, tokens, make_blocks(chain, tokens, "shuffle-zstd"), codec="shuffle-zstd")
    export = interchange.session_export(store, "second")
    assert export.codec == "zstd"  # the shared first block's
    export.write(tmp_path / "s.kv")
    got = read_everything(tmp_path / "s.kv")
    assert got["blocks"] == [fake_raw(chain, tokens[i : i + 4], i) for i in range(0, len(tokens), 4)]


def test_export_of_an_evicted_session_is_refused(tmp_path):
    chain = make_chain()
    store = BlockStore(tmp_path)
    put(store, chain, list(range(10)), "s")
    store.set_budget(0)
    with pytest.raises(StoreError, match="lost 3 of its 3 blocks"):
        interchange.export_session(store, "s", tmp_path / "s.kv")
    with pytest.raises(StoreError, match="no session"):
        interchange.export_session(store, "nope", tmp_path / "n.kv")


def test_import_refuses_a_damaged_snapshot(tmp_path):
    w = write_test_snapshot(tmp_path / "x.kv", num_tokens=12)
    data = bytearray(w.path.read_bytes())
    data[-3] ^= 0xFF  # inside the last block
    w.path.write_bytes(bytes(data))
    store = BlockStore(tmp_path / "store")
    with pytest.raises(SnapshotError):
        interchange.import_snapshot(store, w.path)
    assert store.stats()["blocks"] == 0


def test_errors_are_one_family():
    assert issubclass(StoreError, KvsnapError)


@pytest.mark.parametrize(
    ("text", "size"),
    [("200MB", 200_000_000), ("2GB", 2_000_000_000), ("1.5GiB", 1536 * 1024**2), ("4096", 4096), (" 10 kb ", 10_000)],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "MB", "-1", "12XB", "1e9"])
def test_parse_size_refuses(text):
    with pytest.raises(ConfigError):
        parse_size(text)


def test_peek_answers_while_a_writer_holds_the_lock(tmp_path):
    """A serving engine's scheduler looks prompts up with ``peek``: it must not wait for another process's save."""
    import threading

    chain = make_chain()
    store = BlockStore(tmp_path)
    tokens = list(range(10))
    put(store, chain, tokens)
    held, release = threading.Event(), threading.Event()

    def writer() -> None:
        with store.transaction(write=True):
            held.set()
            release.wait(30)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert held.wait(30)
        match = store.peek(tokens + [99], chain.root, 4)
        assert match.hit_tokens == 8 and len(match.hashes) == 2
    finally:
        release.set()
        thread.join()
    before = store.stats()
    store.peek(tokens, chain.root, 4)
    assert store.stats()["lookups"] == before["lookups"]  # nothing recorded, nothing touched
