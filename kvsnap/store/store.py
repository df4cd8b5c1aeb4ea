"""A directory of KV blocks shared by many sessions: content-addressed, deduplicated, under a budget.

The folder's files are described in ``files``; the bookkeeping (tree, LRU clock, pins) is the
``BlockIndex`` of ``index``. A block is stored once however many sessions use it. Every change runs
under the exclusive lock: load the index, write new files (temp file, fsync, rename), write the
index, and only then delete the files of evicted blocks. A crash leaves at worst unreferenced
files, which ``gc`` removes; the index never names a file that was not written first. Every block
read is checked against its checksum, and a damaged block is never used: ``get`` refuses it with
``StoreError``, ``fetch`` treats it as a miss and drops it with the blocks below it. A lookup that
cannot record its use (a full disk, a read-only store) still answers. Each block file names its
block in a trailer, so ``repair`` can rebuild a lost index (``upkeep``: check, gc, repair).

The budget bounds the stored bytes of blocks (not their trailers, a few hundred bytes each).
Session records (token ids, chat messages, logits) are small and are not evicted; blocks of
pinned sessions are kept even beyond the budget. ``.kv`` export and import live in
``interchange``. No torch here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvsnap.config import DEFAULT_LEVEL
from kvsnap.errors import ConfigError, StoreError
from kvsnap.format.atomic import fsync_dir
from kvsnap.sealing import SealKey
from kvsnap.store import upkeep
from kvsnap.store.files import BLOB_LIMIT, StoreFiles, has_file
from kvsnap.store.folder import open_store, remove_own
from kvsnap.store.index import BlockIndex
from kvsnap.store.records import (
    BlockRecord,
    ChainInfo,
    GcReport,
    PutResult,
    RepairReport,
    SessionRecord,
    StoredBlock,
    StoreMatch,
    block_keys,
    record_problem,
)
from kvsnap.store.txn import Txn, put_blocks, put_result
from kvsnap.types import EncodedBlock


class BlockStore:
    """A directory-backed, content-addressed store of encoded KV blocks keyed by chained block hash.

    Safe for several processes (and threads) at once: each call is one transaction under an
    fcntl lock on ``DIR/.lock``. ``budget_bytes``, when given, becomes the store's budget (kept in
    its index) and is enforced at once. With ``create`` a new or empty folder becomes a store; a
    folder holding anything else is refused (``StoreError``) unless it is a kvsnap store already.
    A store made with ``key`` is encrypted (``sealed_files``) and opens with that key only (default:
    ``$KVSNAP_KEY_FILE``'s); a plain store refuses a key.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        budget_bytes: int | None = None,
        *,
        create: bool = True,
        key: SealKey | None = None,
    ):
        self.path = Path(path)
        self.files = open_store(StoreFiles(self.path), create, key)
        if budget_bytes is not None:
            self.set_budget(budget_bytes)

    @property
    def key(self) -> SealKey | None:
        """The key an encrypted store's files are sealed with; None for a plain store."""
        return self.files.key

    # -- reading ---------------------------------------------------------------------------------

    def read_index(self) -> BlockIndex:
        """A copy of the index as it is now (for views, checks and tests)."""
        with self.transaction(write=False) as t:
            return t.index

    def stats(self) -> dict[str, Any]:
        """Counts: ``blocks``, ``bytes``, ``budget_bytes``, ``sessions``, ``hits``, ``evictions`` and more."""
        return {"path": str(self.path), **self.read_index().stats()}

    def tree(self) -> dict[str, Any]:
        """The radix view of the stored blocks (see ``BlockIndex.tree``)."""
        return self.read_index().tree()

    def sessions(self) -> list[SessionRecord]:
        return list(self.read_index().sessions.values())

    def info(self, h: bytes) -> BlockRecord | None:
        return self.read_index().blocks.get(h)

    def lookup(self, prompt_ids: Sequence[int], root: bytes, block_size: int, *, touch: bool = True) -> StoreMatch:
        """Longest run of the prompt's full blocks in the store, each hash hit re-checked against its token ids.

        With ``touch`` (the default) the blocks found become the most recently used and the lookup
        counts in the hit statistics; without, the store is only read (shared lock).
        """
        with self.transaction(write=touch) as t:
            if touch:
                t.optional = True
                return t.index.lookup(prompt_ids, root, block_size)
            return t.index.match(prompt_ids, root, block_size)

    def peek(self, prompt_ids: Sequence[int], root: bytes, block_size: int) -> StoreMatch:
        """``lookup`` that never waits: no lock, no touch, the index as last written (every write
        replaces it whole). For a caller that must not stall behind another process's save (a serving
        engine's scheduler); a block found may be evicted before it is read, and ``fetch`` stops there."""
        return self.files.load_index().match(prompt_ids, root, block_size)

    def fetch(self, prompt_ids: Sequence[int], root: bytes, block_size: int) -> tuple[StoreMatch, list[StoredBlock]]:
        """``lookup`` and read the matched blocks in one transaction, so no other process evicts them between.

        A block that fails its checksum (or whose entry cannot describe a block of its chain) ends
        the match there (a miss costs a recompute, a damaged block would cost a wrong answer) and is
        dropped from the store with the blocks below it; ``match.dropped`` says so. Past the indexed
        match, block files a killed writer completed are adopted once their trailers prove them
        (``upkeep.adopt_following``); one that cannot be is named in ``match.dropped`` too.
        """
        with self.transaction(write=True) as t:
            t.optional = True
            index = t.index
            found = index.match(prompt_ids, root, block_size)
            # A writer killed between its block files and its index write left them complete.
            adopted, dropped = upkeep.adopt_following(self.files, index, prompt_ids, root, block_size, found.hashes)
            blocks: list[StoredBlock] = []
            for h in (*found.hashes, *adopted):
                record = index.blocks[h]
                try:
                    problem = record_problem(record, index.chains.get(root))
                    if problem is not None:
                        raise StoreError(f"index entry is damaged ({problem})")
                    data = self.files.read_block(record)
                except StoreError as exc:
                    index.counters["damaged"] += 1
                    t.drop_subtree(self.files, h)
                    dropped.append(f"dropped damaged block {h.hex()[:12]} from the store: {exc}")
                    break
                blocks.append(StoredBlock(record, data))
            hashes = tuple(b.record.hash for b in blocks)
            match = StoreMatch(len(blocks) * block_size, block_size, hashes, tuple(dropped))
            index.record_lookup(prompt_ids, match)
            return match, blocks

    def drop_damaged(self, h: bytes, reason: str) -> str:
        """Drop block ``h`` and the blocks below it: a reader found it unusable (it did not decode).
        Returns the line that says so. Best effort: a store that cannot be written keeps it."""
        with self.transaction(write=True) as t:
            t.optional = True
            if h in t.index.blocks:
                t.index.counters["damaged"] += 1
                t.drop_subtree(self.files, h)
        return f"dropped damaged block {h.hex()[:12]} from the store: {reason}"

    def get(self, h: bytes) -> bytes:
        """The stored bytes of block ``h``, checksum verified; ``StoreError`` if absent or damaged."""
        with self.transaction(write=False) as t:
            record = t.index.blocks.get(h)
            if record is None:
                raise StoreError(f"block {h.hex()[:12]} is not in the store")
            return self.files.read_block(record)

    # -- writing ---------------------------------------------------------------------------------

    def put(
        self,
        chain: ChainInfo,
        token_ids: Sequence[int],
        blocks: Sequence[EncodedBlock | None],
        *,
        codec: str,
        level: int = DEFAULT_LEVEL,
        made_by: str = "",
    ) -> PutResult:
        """Store the full blocks of ``token_ids`` (deduplicated), then evict to the budget.

        ``blocks[i]`` is block ``i`` of the tokens encoded with ``codec``, or None for a block the
        caller knows is stored already (see ``lookup``); a partial tail block is ignored. If a None
        block turns out to be gone, only the blocks before it are stored. New blocks record
        ``made_by`` (``kvsnap.provenance.encode``: the software and device that computed them).
        """
        with self.transaction(write=True) as t:
            hashes, new, reused = put_blocks(
                self.files, t, chain, token_ids, blocks, codec, level, with_tail=False, made_by=made_by
            )
            evicted = t.evict(self.files)
            t.optional = new == 0 and not evicted  # only recency changed
            return put_result(t.index, hashes, new, reused, evicted)

    def add_session(
        self,
        name: str,
        chain: ChainInfo,
        token_ids: Sequence[int],
        blocks: Sequence[EncodedBlock | None],
        *,
        codec: str,
        level: int = DEFAULT_LEVEL,
        pin: bool | None = None,
        messages: Sequence[dict[str, str]] | None = None,
        last_logits: np.ndarray | None = None,
        extra: dict[str, Any] | None = None,
        made_by: str = "",
    ) -> PutResult:
        """Store every block of ``token_ids`` (the partial tail too) and record them as session ``name``.

        Replaces a session of that name; ``pin=None`` keeps its pin (a new session is unpinned).
        Blocks (and ``made_by``) are given as for ``put``. Eviction to the budget runs after the session is recorded,
        so a pinned session's blocks are safe from it.
        """
        if not isinstance(name, str) or not name.strip() or "\x00" in name:
            raise StoreError(f"invalid session name {name!r}")
        if not token_ids:
            raise StoreError(f"session {name!r} has no tokens")
        logits = None
        if last_logits is not None:
            logits = np.ascontiguousarray(last_logits, dtype="<f4").reshape(-1).tobytes()
            if len(logits) > BLOB_LIMIT:
                raise StoreError(f"last-position logits of {len(logits):,} bytes are more than the store keeps")
        with self.transaction(write=True) as t:
            index = t.index
            hashes, new, reused = put_blocks(
                self.files, t, chain, token_ids, blocks, codec, level, with_tail=True, made_by=made_by
            )
            old = index.sessions.get(name)
            logits_id = None
            if logits is not None:
                logits_id = self.files.blob_id(logits)
                path = self.files.blob_path(logits_id)
                if not has_file(path, self.files.sealed_size(len(logits))):
                    self._write(t, path, [logits])
            index.set_session(
                SessionRecord(
                    name=name,
                    root=chain.root,
                    token_ids=tuple(int(x) for x in token_ids),
                    hashes=tuple(block_keys(token_ids, chain.block_size, chain.root)),
                    pinned=pin if pin is not None else (old.pinned if old is not None else False),
                    messages=tuple(dict(m) for m in messages) if messages is not None else None,
                    extra=dict(extra or {}),
                    logits=logits_id,
                )
            )
            if old is not None:
                self._forget_blob(t, old.logits)
            evicted = t.evict(self.files)
            return put_result(index, hashes, new, reused, evicted)

    def pin(self, name: str) -> None:
        """Keep session ``name``'s blocks from eviction (reference counted across sessions)."""
        with self.transaction(write=True) as t:
            t.index.set_session(dataclasses.replace(self._session(t.index, name), pinned=True))

    def unpin(self, name: str) -> list[bytes]:
        """Let session ``name``'s blocks be evicted again; evicts to the budget at once and returns what went."""
        with self.transaction(write=True) as t:
            t.index.set_session(dataclasses.replace(self._session(t.index, name), pinned=False))
            return t.evict(self.files)

    def remove_session(self, name: str) -> list[bytes]:
        """Forget session ``name`` (its blocks stay, as cache); returns the blocks evicted to fit the budget."""
        with self.transaction(write=True) as t:
            session = self._session(t.index, name)
            t.index.remove_session(name)
            self._forget_blob(t, session.logits)
            return t.evict(self.files)

    def set_budget(self, budget_bytes: int | None) -> list[bytes]:
        """Change the store's budget (None: unbounded) and evict to it; returns the evicted blocks in order."""
        if budget_bytes is not None and budget_bytes < 0:
            raise ConfigError(f"budget {budget_bytes} is negative")
        with self.transaction(write=True) as t:
            same = t.index.budget_bytes == budget_bytes
            t.index.budget_bytes = budget_bytes
            evicted = t.evict(self.files)
            t.optional = same and not evicted
            return evicted

    def evict_to_budget(self) -> list[bytes]:
        """Evict least recently used leaves (never one with a stored child or a pin) until the budget holds."""
        with self.transaction(write=True) as t:
            return t.evict(self.files)

    # -- upkeep (kvsnap.store.upkeep says what each may delete) --------------------------------------

    def gc(self, *, verify: bool = True) -> GcReport:
        """Tidy: remove crash leftovers and files the index does not name, drop blocks a run could not
        use (with ``verify``: read and decoded) and what is below them, drop unpinned sessions with no
        block left, fit the budget. Refused while the index is missing or unreadable (``repair`` first)."""
        return upkeep.gc(self.files, self.transaction, verify)

    def check(self) -> list[str]:
        """Problems found reading the whole store as runs read it (empty when sound)."""
        return upkeep.check(self.files)

    def repair(self) -> RepairReport:
        """Rebuild the index from what the block files prove; deletes nothing (see ``upkeep.repair``)."""
        return upkeep.repair(self.files)

    def read_session(self, name: str) -> tuple[ChainInfo, SessionRecord, list[StoredBlock], bytes | None]:
        """Session ``name`` whole, in one transaction: its chain, record, every block (checked) and
        its logits; ``StoreError`` if a block is gone or damaged."""
        with self.transaction(write=False) as t:
            index = t.index
            session = self._session(index, name)
            present = index.present_blocks(session)
            if present < len(session.hashes):
                raise StoreError(
                    f"session {name!r} lost {len(session.hashes) - present} of its {len(session.hashes)} blocks "
                    "to eviction (pin a session to keep it whole)"
                )
            records = [index.blocks[h] for h in session.hashes]
            blocks = [StoredBlock(r, self.files.read_block(r)) for r in records]
            logits = self.files.read_blob(session.logits) if session.logits is not None else None
            return index.chains[session.root], session, blocks, logits

    # -- internals -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def transaction(self, write: bool) -> Iterator[Txn]:
        """One transaction: the lock, a freshly loaded index and, for writers, the index written back
        (then the files it dropped are deleted)."""
        with self.files.lock(exclusive=write):
            t = Txn(self.files.load_index())
            yield t
            if write:
                for folder in t.dirs:
                    fsync_dir(folder)
                try:
                    self.files.save_index(t.index)
                except StoreError:
                    if t.optional:
                        return  # nothing but recency is lost; the index still names every doomed file
                    raise
                fsync_dir(self.path)
                # Only now that the index no longer names them.
                for p in t.doomed:
                    remove_own(p)

    @staticmethod
    def _session(index: BlockIndex, name: str) -> SessionRecord:
        session = index.sessions.get(name)
        if session is None:
            raise StoreError(f"no session {name!r} in the store")
        return session

    def _forget_blob(self, t: Txn, blob_id: str | None) -> None:
        if blob_id is not None and all(s.logits != blob_id for s in t.index.sessions.values()):
            t.doomed.append(self.files.blob_path(blob_id))

    def _write(self, t: Txn, path: Path, parts: list[bytes | memoryview]) -> None:
        t.write(self.files, path, parts)
