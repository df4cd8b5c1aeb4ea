"""Replay the prefix-caching seed's experiment on the block store's bookkeeping (no model needed).

Six requests share one system prompt: three chats of two turns each (a turn-2 prompt repeats its
turn 1 and the answer, then asks again). They run twice through a cache of 24 blocks of 4 tokens;
then the capacity shrinks to 8 for two more cycles; then a capacity sweep on a fresh cache. Only
the prompt's full blocks are cached after each request, as in the seed's simulator (one extra
table stores prompt + answer, as ``kvsnap run --store`` will).

Leaf-only LRU is ``kvsnap.blockindex.BlockIndex``, the bookkeeping ``BlockStore`` runs; the
24 -> 8 phases are replayed through a real ``BlockStore`` in a temporary folder as well and must
count the same. Beside it, a plain LRU that evicts the least recently used block wherever it sits
in the tree, leaving the blocks below it unreachable while they still take room.

    .venv/bin/python benchmarks/store_replay.py [--capacities 4 6 8 10 12 16 20 24 32]
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import table, write_json  # noqa: E402
from kvsnap import hashing  # noqa: E402
from kvsnap.format import encode_block  # noqa: E402
from kvsnap.store import (  # noqa: E402
    BlockIndex,
    BlockRecord,
    BlockStore,  # noqa: E402
    ChainInfo,
)
from kvsnap.types import KVLayout  # noqa: E402

BLOCK_SIZE = 4
LAYOUT = KVLayout(1, 1, 1, "float32")  # 4 bytes a token: a block of the replay store is 16 bytes
ROOT = hashing.chain_root("replay-model", "", BLOCK_SIZE)
CHAIN = ChainInfo(ROOT, "replay", "replay-model", LAYOUT, BLOCK_SIZE)
SYSTEM = list(range(1000, 1012))  # 12 tokens: 3 blocks
# Per chat: first question, first answer, second question, second answer (token counts).
CHATS = [(6, 9, 5, 7), (7, 6, 6, 8), (5, 8, 7, 6)]


def _span(chat: int, part: int, length: int) -> list[int]:
    return [2000 + 1000 * chat + 100 * part + i for i in range(length)]


def requests() -> list[tuple[str, list[int], list[int]]]:
    """The six requests in arrival order: (label, prompt ids, answer ids)."""
    turn1, turn2 = [], []
    for c, (q1, a1, q2, a2) in enumerate(CHATS):
        first = SYSTEM + _span(c, 0, q1)
        turn1.append((f"chat{c}/turn1", first, _span(c, 1, a1)))
        turn2.append((f"chat{c}/turn2", first + _span(c, 1, a1) + _span(c, 2, q2), _span(c, 3, a2)))
    return turn1 + turn2


class LeafLRU:
    """The store's policy, in memory: ``BlockIndex`` with every block 1 byte, so the budget counts blocks."""

    name = "leaf-only LRU"

    def __init__(self, capacity: int):
        self.index = BlockIndex(capacity)
        self.index.add_chain(CHAIN)

    def lookup(self, ids: Sequence[int]) -> int:
        return self.index.lookup(ids, ROOT, BLOCK_SIZE).full_blocks

    def insert(self, ids: Sequence[int]) -> None:
        parent = ROOT
        for i, h in enumerate(hashing.chain_hashes(ids, BLOCK_SIZE, ROOT)):
            tokens = tuple(ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
            self.index.put(BlockRecord(h, parent, ROOT, tokens, True, 1, 1, "", "raw", 0))
            parent = h
        self.index.evict()

    def resize(self, capacity: int) -> None:
        self.index.budget_bytes = capacity
        self.index.evict()

    @property
    def evictions(self) -> int:
        return self.index.counters["evictions"]

    def unreachable(self) -> int:
        return 0  # leaves only: every stored block's parent is stored (BlockIndex.check)


class PlainLRU:
    """LRU over every block, inner ones included: evicting a parent strands its subtree until it ages out."""

    name = "plain LRU"

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.blocks: dict[bytes, tuple[bytes, tuple[int, ...]]] = {}  # hash -> (parent, token ids)
        self.last_use: dict[bytes, int] = {}
        self.clock = 0
        self.evictions = 0

    def _touch(self, h: bytes) -> None:
        self.clock += 1
        self.last_use[h] = self.clock

    def lookup(self, ids: Sequence[int]) -> int:
        parent, hits = ROOT, 0
        for i, h in enumerate(hashing.chain_hashes(ids, BLOCK_SIZE, ROOT)):
            known = self.blocks.get(h)
            if known is None or known != (parent, tuple(ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])):
                break
            self._touch(h)
            parent, hits = h, hits + 1
        return hits

    def insert(self, ids: Sequence[int]) -> None:
        parent = ROOT
        for i, h in enumerate(hashing.chain_hashes(ids, BLOCK_SIZE, ROOT)):
            self.blocks.setdefault(h, (parent, tuple(ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])))
            self._touch(h)
            parent = h
        self._evict()

    def resize(self, capacity: int) -> None:
        self.capacity = capacity
        self._evict()

    def _evict(self) -> None:
        while len(self.blocks) > self.capacity:
            victim = min(self.blocks, key=self.last_use.__getitem__)
            del self.blocks[victim], self.last_use[victim]
            self.evictions += 1

    def unreachable(self) -> int:
        """Blocks whose chain back to the root is broken: taking room, never to be hit again."""
        reachable = {ROOT}
        for h in sorted(self.blocks, key=self._depth):
            if self.blocks[h][0] in reachable:
                reachable.add(h)
        return len(self.blocks) - (len(reachable) - 1)

    def _depth(self, h: bytes) -> int:
        depth = 0
        while h in self.blocks:
            h = self.blocks[h][0]
            depth += 1
        return depth


def replay(policy, cycles: int, *, with_answers: bool = False) -> dict[str, Any]:
    """Run the six requests ``cycles`` times through ``policy``; the tallies of these cycles."""
    sys_blocks = len(SYSTEM) // BLOCK_SIZE
    t = dict.fromkeys(("requests", "blocks", "block_hits", "prompt_tokens", "hit_tokens", "system_hits"), 0)
    evictions0 = policy.evictions
    for _ in range(cycles):
        for _, prompt, answer in requests():
            hits = policy.lookup(prompt)
            policy.insert(prompt + answer if with_answers else prompt)
            t["requests"] += 1
            t["blocks"] += len(prompt) // BLOCK_SIZE
            t["block_hits"] += hits
            t["prompt_tokens"] += len(prompt)
            t["hit_tokens"] += hits * BLOCK_SIZE
            t["system_hits"] += hits >= sys_blocks
    t["block_hit_rate"] = t["block_hits"] / t["blocks"]
    t["token_reuse"] = t["hit_tokens"] / t["prompt_tokens"]
    t["prefill_tokens"] = t["prompt_tokens"] - t["hit_tokens"]
    t["evictions"] = policy.evictions - evictions0
    t["unreachable"] = policy.unreachable()
    return t


def seed_phases(policy_cls, *, with_answers: bool = False) -> list[dict[str, Any]]:
    """Capacity 24 for two cycles, then shrunk to 8 for two more, on one cache."""
    policy = policy_cls(24)
    rows = [{"policy": policy.name, "phase": "24 blocks, cycles 1-2", **replay(policy, 2, with_answers=with_answers)}]
    policy.resize(8)
    rows.append(
        {"policy": policy.name, "phase": "shrunk to 8, cycles 3-4", **replay(policy, 2, with_answers=with_answers)}
    )
    return rows


def store_phases() -> list[dict[str, Any]]:
    """The same two phases through a real BlockStore (files, lock, JSON index) in a temporary folder."""
    block_bytes = BLOCK_SIZE * LAYOUT.bytes_per_token
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store = BlockStore(tmp, budget_bytes=24 * block_bytes)
        for capacity in (24, 8):
            store.set_budget(capacity * block_bytes)
            before = store.stats()
            for _ in range(2):
                for _, prompt, _ in requests():
                    match = store.lookup(prompt, ROOT, BLOCK_SIZE)
                    blocks = [
                        None if i < match.full_blocks else encode_block(bytes(block_bytes), BLOCK_SIZE, h, 4, "raw")
                        for i, h in enumerate(hashing.chain_hashes(prompt, BLOCK_SIZE, ROOT))
                    ]
                    store.put(CHAIN, prompt, blocks, codec="raw")
            after = store.stats()
            assert store.check() == []
            rows.append({k: after[k] - before[k] for k in ("hits", "lookup_blocks", "hit_tokens", "evictions")})
    return rows


def sweep(capacities: Sequence[int]) -> list[dict[str, Any]]:
    rows = []
    for capacity in capacities:
        leaf, plain = replay(LeafLRU(capacity), 2), replay(PlainLRU(capacity), 2)
        rows.append(
            {
                "capacity": capacity,
                "leaf_hit_rate": leaf["block_hit_rate"],
                "plain_hit_rate": plain["block_hit_rate"],
                "leaf_reuse": leaf["token_reuse"],
                "plain_reuse": plain["token_reuse"],
                "leaf_evictions": leaf["evictions"],
                "plain_evictions": plain["evictions"],
                "leaf_system_hits": leaf["system_hits"],
                "plain_system_hits": plain["system_hits"],
                "plain_unreachable": plain["unreachable"],
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--capacities", type=int, nargs="+", default=[4, 6, 7, 8, 10, 12, 16, 20, 24, 32])
    args = parser.parse_args()

    phases = seed_phases(LeafLRU) + seed_phases(PlainLRU)
    with_answers = seed_phases(LeafLRU, with_answers=True) + seed_phases(PlainLRU, with_answers=True)
    store_rows = store_phases()
    for mem, real in zip(phases[:2], store_rows):
        # The real store must count exactly what its bookkeeping counted in memory.
        assert (mem["block_hits"], mem["blocks"], mem["hit_tokens"], mem["evictions"]) == (
            real["hits"],
            real["lookup_blocks"],
            real["hit_tokens"],
            real["evictions"],
        ), (mem, real)
    sweep_rows = sweep(args.capacities)

    for row in phases + with_answers:
        row["hits_of_blocks"] = f"{row['block_hits']}/{row['blocks']}"
        row["reused_of_tokens"] = f"{row['hit_tokens']}/{row['prompt_tokens']}"
        row["system_of_requests"] = f"{row['system_hits']}/{row['requests']}"
    phase_cols = [
        ("policy", "policy", "s"),
        ("phase", "phase", "s"),
        ("hits_of_blocks", "block hits", "s"),
        ("block_hit_rate", "hit rate", ".1%"),
        ("reused_of_tokens", "prefill tokens reused", "s"),
        ("token_reuse", "reused", ".1%"),
        ("evictions", "evictions", "d"),
        ("system_of_requests", "system prompt hit", "s"),
        ("unreachable", "unreachable blocks", "d"),
    ]
    print(f"Seed replay: 6 requests (3 chats x 2 turns) sharing a {len(SYSTEM)}-token system prompt, block size 4")
    print(table(phases, phase_cols))
    print("(24-block and shrunk-to-8 phases replayed through a real BlockStore too: identical counts)")
    print()
    print("Same, storing prompt + answer after each request (what `kvsnap run --store` saves)")
    print(table(with_answers, phase_cols))
    print()
    print("Capacity sweep, fresh cache, 2 cycles (12 requests)")
    print(
        table(
            sweep_rows,
            [
                ("capacity", "capacity", "d"),
                ("leaf_hit_rate", "leaf hit", ".1%"),
                ("plain_hit_rate", "plain hit", ".1%"),
                ("leaf_reuse", "leaf reused", ".1%"),
                ("plain_reuse", "plain reused", ".1%"),
                ("leaf_evictions", "leaf evict", "d"),
                ("plain_evictions", "plain evict", "d"),
                ("leaf_system_hits", "leaf sys hit /12", "d"),
                ("plain_system_hits", "plain sys hit /12", "d"),
                ("plain_unreachable", "plain unreachable", "d"),
            ],
        )
    )
    path = write_json(
        "store_replay",
        {
            "workload": {
                "block_size": BLOCK_SIZE,
                "system_prompt_tokens": len(SYSTEM),
                "chats": [dict(zip(("q1", "a1", "q2", "a2"), c)) for c in CHATS],
                "requests": [{"label": label, "prompt_tokens": len(p)} for label, p, _ in requests()],
            },
            "phases": phases,
            "phases_with_answers": with_answers,
            "store_check": store_rows,
            "sweep": sweep_rows,
            "python": platform.python_version(),
        },
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
