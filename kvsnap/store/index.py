"""The block store's bookkeeping, in memory: which blocks exist, their tree, the LRU clock, pins.

No files, no locks, no torch: ``BlockStore`` (kvsnap/store/store.py) loads a ``BlockIndex`` from its
JSON index under a file lock, changes it, and writes block files and the index back; tests and
the replay benchmark drive the same logic without a filesystem.

Blocks form a forest. A block's parent is the block before it in its chain, or the chain root
(model fingerprint + namespace + block size, ``kvsnap.hashing.chain_root``) for a chain's first
block. A block's hash derives from its parent's, so a block whose parent is gone can never be
found again: eviction takes leaves only (blocks with no stored child), never a block that a
pinned session uses, least recently used first. A shared system prompt, an inner node with many
children, is never a candidate while anything below it is stored.

The clock is a counter, not wall time: every touch takes the next value, blocks of one chain in
order, so recency is a strict total order and every run replays the same way.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from kvsnap import prefix, provenance
from kvsnap.errors import StoreError
from kvsnap.store.records import BlockRecord, ChainInfo, SessionRecord, StoreMatch

INDEX_FORMAT = "kvsnap-store"
INDEX_VERSION = 1
COUNTERS = ("lookups", "lookup_blocks", "hits", "prompt_tokens", "hit_tokens", "evictions", "damaged")


class BlockIndex:
    """Blocks, their parent/child links, last use, pins and sessions, with leaf-only LRU eviction.

    Invariants (``check`` lists violations): every block's parent is a stored block or a known
    chain root; ``children`` holds exactly the stored blocks under each parent; ``num_bytes`` is
    the sum of stored block sizes; ``pins[h]`` counts the pinned sessions that use ``h``.
    """

    def __init__(self, budget_bytes: int | None = None):
        self.budget_bytes = budget_bytes
        self.clock = 0
        self.chains: dict[bytes, ChainInfo] = {}
        self.blocks: dict[bytes, BlockRecord] = {}
        self.last_use: dict[bytes, int] = {}
        self.children: dict[bytes, set[bytes]] = {}  # parent (block or root) -> stored children
        self.sessions: dict[str, SessionRecord] = {}
        self.pins: Counter[bytes] = Counter()
        self.num_bytes = 0
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)

    # -- chains and blocks ----------------------------------------------------------------------

    def add_chain(self, chain: ChainInfo) -> None:
        known = self.chains.get(chain.root)
        if known is None:
            self.chains[chain.root] = chain
        # The model's name is only a label (a folder path and an alias can name the same model);
        # the fingerprint, layout and block size are what the root stands for.
        elif (known.fingerprint, known.layout, known.block_size) != (chain.fingerprint, chain.layout, chain.block_size):
            raise StoreError(
                f"chain root {chain.root.hex()[:12]} is stored for {known.model} (block size {known.block_size}, "
                f"{known.layout.dtype}), not {chain.model} (block size {chain.block_size}, {chain.layout.dtype})"
            )
        elif chain.parts and not known.parts:
            self.chains[chain.root] = chain  # a chain recorded before its parts were kept gains them

    def put(self, record: BlockRecord) -> bool:
        """Add a block (or find it already stored) and touch it; True when it is new.

        A stored block with this hash but another parent or other token ids is a hash collision:
        refused, so the wrong KV is never reused under this key.
        """
        known = self.blocks.get(record.hash)
        if known is not None:
            if (known.parent, known.root, known.token_ids) != (record.parent, record.root, record.token_ids):
                raise StoreError(f"hash collision: block {record.hash.hex()[:12]} is stored for other tokens")
            self.touch([record.hash])
            return False
        if record.root not in self.chains:
            raise StoreError(f"block {record.hash.hex()[:12]} belongs to an unknown chain root")
        if record.parent != record.root:
            parent = self.blocks.get(record.parent)
            if parent is None:
                raise StoreError(f"block {record.hash.hex()[:12]}: its parent is not in the store")
            if not parent.full:
                raise StoreError(f"block {record.hash.hex()[:12]}: its parent is a partial block")
        self.blocks[record.hash] = record
        self.children.setdefault(record.parent, set()).add(record.hash)
        self.num_bytes += record.stored_bytes
        self.touch([record.hash])
        return True

    def touch(self, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            self.clock += 1
            self.last_use[h] = self.clock

    def remove(self, h: bytes) -> BlockRecord:
        """Drop one leaf block (the caller deletes its file)."""
        record = self.blocks.pop(h)
        assert not self.children.get(h), "only a leaf can be removed"
        self.children.pop(h, None)
        siblings = self.children[record.parent]
        siblings.discard(h)
        if not siblings:
            del self.children[record.parent]
        del self.last_use[h]
        self.num_bytes -= record.stored_bytes
        return record

    def remove_subtree(self, h: bytes) -> list[bytes]:
        """Drop a block and everything below it (a damaged or missing block); returns the hashes, leaves first."""
        order: list[bytes] = []
        stack = [h]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(self.children.get(node, ()))
        for node in reversed(order):
            self.remove(node)
        return order[::-1]

    # -- lookup ---------------------------------------------------------------------------------

    def match(self, prompt_ids: Sequence[int], root: bytes, block_size: int) -> StoreMatch:
        """Longest run of the prompt's full blocks stored under ``root``; changes nothing."""
        chain = self.chains.get(root)
        if chain is None:
            return StoreMatch(0, block_size, ())
        if chain.block_size != block_size:
            raise ValueError(f"root {root.hex()[:12]} is a chain of block size {chain.block_size}, not {block_size}")

        def accept(_i: int, h: bytes, parent: bytes, block: Sequence[int]) -> bool:
            record = self.blocks.get(h)
            # Parent, root and token ids must compare equal too: a hash collision stops here.
            return (
                record is not None
                and record.full
                and record.parent == parent
                and record.root == root
                and record.token_ids == tuple(block)
            )

        hashes = prefix.matching_blocks(prompt_ids, block_size, root, accept)
        return StoreMatch(len(hashes) * block_size, block_size, tuple(hashes))

    def record_lookup(self, prompt_ids: Sequence[int], match: StoreMatch) -> None:
        """Touch a match's blocks and count it in the hit statistics."""
        self.touch(match.hashes)
        c = self.counters
        c["lookups"] += 1
        c["lookup_blocks"] += len(prompt_ids) // match.block_size
        c["hits"] += match.full_blocks
        c["prompt_tokens"] += len(prompt_ids)
        c["hit_tokens"] += match.hit_tokens

    def lookup(self, prompt_ids: Sequence[int], root: bytes, block_size: int) -> StoreMatch:
        """``match``, then touch the blocks found and count the lookup."""
        match = self.match(prompt_ids, root, block_size)
        self.record_lookup(prompt_ids, match)
        return match

    # -- eviction -------------------------------------------------------------------------------

    def evictable(self, h: bytes) -> bool:
        """A stored leaf that no pinned session uses."""
        return h in self.blocks and not self.children.get(h) and self.pins[h] == 0

    def evict(self, budget_bytes: int | None = None) -> list[bytes]:
        """Evict least recently used evictable leaves until the blocks fit the budget; returns them in order.

        Stops early, over budget, when every leaf left is pinned. ``budget_bytes`` defaults to the
        index's own budget; with neither, nothing is evicted.
        """
        budget = self.budget_bytes if budget_bytes is None else budget_bytes
        if budget is None or self.num_bytes <= budget:
            return []
        heap = [(self.last_use[h], h) for h in self.blocks if self.evictable(h)]
        heapq.heapify(heap)
        evicted: list[bytes] = []
        while self.num_bytes > budget and heap:
            _, h = heapq.heappop(heap)
            record = self.remove(h)
            evicted.append(h)
            # Its parent may just have become a leaf.
            if self.evictable(record.parent):
                heapq.heappush(heap, (self.last_use[record.parent], record.parent))
        self.counters["evictions"] += len(evicted)
        return evicted

    # -- sessions -------------------------------------------------------------------------------

    def set_session(self, session: SessionRecord) -> None:
        """Add or replace a session (its pins move with it)."""
        self.remove_session(session.name)
        self.sessions[session.name] = session
        if session.pinned:
            self.pins.update(session.hashes)

    def remove_session(self, name: str) -> SessionRecord | None:
        session = self.sessions.pop(name, None)
        if session is not None and session.pinned:
            self.pins.subtract(session.hashes)
            self.pins = +self.pins  # drop zero counts
        return session

    def present_blocks(self, session: SessionRecord) -> int:
        """How many of a session's blocks, from its first, are still stored."""
        n = 0
        for h in session.hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    # -- views ----------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {
            "blocks": len(self.blocks),
            "bytes": self.num_bytes,
            "budget_bytes": self.budget_bytes,
            "sessions": len(self.sessions),
            "pinned_sessions": sum(s.pinned for s in self.sessions.values()),
            "hits": c["hits"],
            "evictions": c["evictions"],
            "lookups": c["lookups"],
            "lookup_blocks": c["lookup_blocks"],
            "block_hit_rate": round(c["hits"] / c["lookup_blocks"], 6) if c["lookup_blocks"] else 0.0,
            "prompt_tokens": c["prompt_tokens"],
            "hit_tokens": c["hit_tokens"],
            "damaged": c["damaged"],
            "roots": len(self.chains),
            "leaves": sum(1 for h in self.blocks if not self.children.get(h)),
            "raw_bytes": sum(r.raw_bytes for r in self.blocks.values()),
            "pinned_bytes": sum(r.stored_bytes for h, r in self.blocks.items() if self.pins[h]),
            "made_by": self.makers(),
        }

    def makers(self) -> list[dict[str, Any]]:
        """Blocks and stored bytes per software that computed them (``made_by`` parsed; None: not
        recorded), most blocks first: blocks that kvsnap and vLLM made share chains, and this tells them apart."""
        counts: Counter[str] = Counter()
        sizes: Counter[str] = Counter()
        for r in self.blocks.values():
            counts[r.made_by] += 1
            sizes[r.made_by] += r.stored_bytes
        order = sorted(counts, key=lambda text: (-counts[text], text))
        return [{"made_by": provenance.parse(t), "blocks": counts[t], "bytes": sizes[t]} for t in order]

    def tree(self) -> dict[str, Any]:
        """The radix view: per chain root, runs of blocks without a branch (or a session end) merged into one node.

        Each node: ``hashes`` (hex), ``blocks``, ``token_ids``, ``bytes`` (stored), ``raw_bytes``,
        ``last_use`` (the latest in the run), ``pins``, ``partial`` (ends in a tail block),
        ``sessions`` (names ending here), ``made_by`` (its blocks' distinct provenances) and
        ``children`` (ordered by first token id).
        """
        ends: dict[bytes, list[str]] = {}
        for s in self.sessions.values():
            if s.hashes:
                ends.setdefault(s.hashes[-1], []).append(s.name)

        def node(h: bytes) -> dict[str, Any]:
            run = [h]
            while h not in ends and len(self.children.get(h, ())) == 1:
                (h,) = self.children[h]
                run.append(h)
            records = [self.blocks[x] for x in run]
            return {
                "hashes": [x.hex() for x in run],
                "blocks": len(run),
                "token_ids": [t for r in records for t in r.token_ids],
                "bytes": sum(r.stored_bytes for r in records),
                "raw_bytes": sum(r.raw_bytes for r in records),
                "last_use": max(self.last_use[x] for x in run),
                "pins": self.pins[run[-1]],
                "partial": not records[-1].full,
                "sessions": sorted(ends.get(h, [])),
                "made_by": [provenance.parse(t) for t in sorted({r.made_by for r in records if r.made_by})],
                "children": below(h),
            }

        def below(parent: bytes) -> list[dict[str, Any]]:
            kids = sorted(self.children.get(parent, ()), key=lambda x: (self.blocks[x].token_ids, x))
            return [node(k) for k in kids]

        roots = []
        for root, chain in sorted(self.chains.items()):
            roots.append(
                {
                    "root": root.hex(),
                    "model": chain.model,
                    "fingerprint": chain.fingerprint,
                    "block_size": chain.block_size,
                    "layout": chain.layout.to_json(),
                    "children": below(root),
                }
            )
        return {"clock": self.clock, "roots": roots}

    def check(self) -> list[str]:
        """Violations of the index's invariants (empty when sound)."""
        problems = []
        for h, r in self.blocks.items():
            if r.hash != h:
                problems.append(f"block {h.hex()[:12]} is recorded under another hash")
            if r.root not in self.chains:
                problems.append(f"block {h.hex()[:12]} has an unknown root")
            if r.parent != r.root and r.parent not in self.blocks:
                problems.append(f"block {h.hex()[:12]} has no stored parent")
            if h not in self.children.get(r.parent, ()):
                problems.append(f"block {h.hex()[:12]} is missing from its parent's children")
            if h not in self.last_use:
                problems.append(f"block {h.hex()[:12]} has no last use")
        for parent, kids in self.children.items():
            for k in kids:
                if k not in self.blocks or self.blocks[k].parent != parent:
                    problems.append(f"child link {parent.hex()[:12]} -> {k.hex()[:12]} is stale")
        if self.num_bytes != sum(r.stored_bytes for r in self.blocks.values()):
            problems.append("byte count does not match the blocks")
        expect = Counter(h for s in self.sessions.values() if s.pinned for h in s.hashes)
        if +expect != +self.pins:
            problems.append("pin counts do not match the pinned sessions")
        return problems
