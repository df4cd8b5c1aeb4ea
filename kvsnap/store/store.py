"""A directory of KV blocks shared by many sessions: content-addressed, deduplicated, under a budget.

The folder's files are described in ``files``; the bookkeeping (tree, LRU clock, pins) is the
``BlockIndex`` of ``index``. A block is stored once however many sessions use it. Every change runs
under the exclusive lock: load the index, write new files (temp file, fsync, rename), write the
index, and only then delete the files of evicted blocks. A crash leaves at worst unreferenced
files, which ``gc`` removes; the index never names a file that was not written first. Every block
read is checked against its checksum, and a damaged block is never used: ``get`` refuses it with
``StoreError``, ``fetch`` treats it as a miss and drops it with the blocks below it.

The budget bounds the stored bytes of blocks. Session records (token ids, chat messages, logits)
are small and are not evicted; blocks of pinned sessions are kept even beyond the budget.
``.kv`` export and import live in ``interchange``. No torch here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvsnap.config import DEFAULT_LEVEL
from kvsnap.errors import ConfigError, StoreError
from kvsnap.format import codec as codecs
from kvsnap.format.atomic import fsync_dir
from kvsnap.store.files import StoreFiles, blob_digest, write_file
from kvsnap.store.index import BlockIndex
from kvsnap.store.records import (
    BlockRecord,
    ChainInfo,
    GcReport,
    PutResult,
    SessionRecord,
    StoredBlock,
    StoreMatch,
    block_keys,
    check_block,
)
from kvsnap.types import EncodedBlock

if TYPE_CHECKING:
    from kvsnap.store.interchange import SessionExport


@dataclass
class _Txn:
    index: BlockIndex
    dirs: set[Path] = dataclasses.field(default_factory=set)  # folders that got new files: fsynced before the index
    doomed: list[Path] = dataclasses.field(default_factory=list)  # deleted once the index no longer names them


class BlockStore:
    """A directory-backed, content-addressed store of encoded KV blocks keyed by chained block hash.

    Safe for several processes (and threads) at once: each call is one transaction under an
    fcntl lock on ``DIR/.lock``. ``budget_bytes``, when given, becomes the store's budget (kept in
    its index) and is enforced at once.
    """

    def __init__(self, path: str | os.PathLike[str], budget_bytes: int | None = None, *, create: bool = True):
        self.path = Path(path)
        self.files = StoreFiles(self.path)
        if not create and not self.files.index_path.is_file():
            raise StoreError(f"{self.path}: no kvsnap block store here")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"{self.path}: cannot create the store ({exc.strerror or exc})") from None
        if not self.path.is_dir():
            raise StoreError(f"{self.path}: not a folder")
        if budget_bytes is not None:
            self.set_budget(budget_bytes)

    # -- reading ---------------------------------------------------------------------------------

    def read_index(self) -> BlockIndex:
        """A copy of the index as it is now (for views, checks and tests)."""
        with self._txn(write=False) as t:
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
        with self._txn(write=touch) as t:
            if touch:
                return t.index.lookup(prompt_ids, root, block_size)
            return t.index.match(prompt_ids, root, block_size)

    def fetch(self, prompt_ids: Sequence[int], root: bytes, block_size: int) -> tuple[StoreMatch, list[StoredBlock]]:
        """``lookup`` and read the matched blocks in one transaction, so no other process evicts them between.

        A block that fails its checksum ends the match there (a miss costs a recompute, a damaged
        block would cost a wrong answer) and is dropped from the store with the blocks below it.
        """
        with self._txn(write=True) as t:
            index = t.index
            found = index.match(prompt_ids, root, block_size)
            blocks = []
            for h in found.hashes:
                record = index.blocks[h]
                try:
                    data = self.files.read_block(record)
                except StoreError:
                    index.counters["damaged"] += 1
                    self._drop(t, h)
                    break
                blocks.append(StoredBlock(record, data))
            match = StoreMatch(len(blocks) * block_size, block_size, tuple(b.record.hash for b in blocks))
            index.record_lookup(prompt_ids, match)
            return match, blocks

    def get(self, h: bytes) -> bytes:
        """The stored bytes of block ``h``, checksum verified; ``StoreError`` if absent or damaged."""
        with self._txn(write=False) as t:
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
    ) -> PutResult:
        """Store the full blocks of ``token_ids`` (deduplicated), then evict to the budget.

        ``blocks[i]`` is block ``i`` of the tokens encoded with ``codec``, or None for a block the
        caller knows is stored already (see ``lookup``); a partial tail block is ignored. If a None
        block turns out to be gone, only the blocks before it are stored.
        """
        with self._txn(write=True) as t:
            hashes, new, reused = self._put(t, chain, token_ids, blocks, codec, level, with_tail=False)
            evicted = self._evict(t)
            return self._result(t.index, hashes, new, reused, evicted)

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
    ) -> PutResult:
        """Store every block of ``token_ids`` (the partial tail too) and record them as session ``name``.

        Replaces a session of that name; ``pin=None`` keeps its pin (a new session is unpinned).
        Blocks are given as for ``put``. Eviction to the budget runs after the session is recorded,
        so a pinned session's blocks are safe from it.
        """
        if not isinstance(name, str) or not name.strip() or "\x00" in name:
            raise StoreError(f"invalid session name {name!r}")
        if not token_ids:
            raise StoreError(f"session {name!r} has no tokens")
        logits = None
        if last_logits is not None:
            logits = np.ascontiguousarray(last_logits, dtype="<f4").reshape(-1).tobytes()
        with self._txn(write=True) as t:
            index = t.index
            hashes, new, reused = self._put(t, chain, token_ids, blocks, codec, level, with_tail=True)
            old = index.sessions.get(name)
            logits_id = None
            if logits is not None:
                logits_id = blob_digest(logits)
                path = self.files.blob_path(logits_id)
                if not path.is_file():
                    self._write(t, path, logits)
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
            evicted = self._evict(t)
            return self._result(index, hashes, new, reused, evicted)

    def pin(self, name: str) -> None:
        """Keep session ``name``'s blocks from eviction (reference counted across sessions)."""
        with self._txn(write=True) as t:
            t.index.set_session(dataclasses.replace(self._session(t.index, name), pinned=True))

    def unpin(self, name: str) -> list[bytes]:
        """Let session ``name``'s blocks be evicted again; evicts to the budget at once and returns what went."""
        with self._txn(write=True) as t:
            t.index.set_session(dataclasses.replace(self._session(t.index, name), pinned=False))
            return self._evict(t)

    def remove_session(self, name: str) -> list[bytes]:
        """Forget session ``name`` (its blocks stay, as cache); returns the blocks evicted to fit the budget."""
        with self._txn(write=True) as t:
            session = self._session(t.index, name)
            t.index.remove_session(name)
            self._forget_blob(t, session.logits)
            return self._evict(t)

    def set_budget(self, budget_bytes: int | None) -> list[bytes]:
        """Change the store's budget (None: unbounded) and evict to it; returns the evicted blocks in order."""
        if budget_bytes is not None and budget_bytes < 0:
            raise ConfigError(f"budget {budget_bytes} is negative")
        with self._txn(write=True) as t:
            t.index.budget_bytes = budget_bytes
            return self._evict(t)

    def evict_to_budget(self) -> list[bytes]:
        """Evict least recently used leaves (never one with a stored child or a pin) until the budget holds."""
        with self._txn(write=True) as t:
            return self._evict(t)

    def gc(self, *, verify: bool = True) -> GcReport:
        """Repair and tidy: remove crash leftovers and unreferenced files, drop missing (and, with ``verify``,
        damaged) blocks with the blocks below them, drop unpinned sessions with no block left, fit the budget."""
        with self._txn(write=True) as t:
            index = t.index
            temp_files = 0
            for p in self.files.walk():
                # Under the exclusive lock no writer is active: a temp file is a crash's leftover.
                if p.name.startswith(".") and p.name.endswith(".tmp"):
                    with contextlib.suppress(OSError):
                        p.unlink()
                        temp_files += 1
            bad = [h for h, r in index.blocks.items() if not self.files.block_sound(r, verify)]
            dropped = 0
            for h in bad:
                if h in index.blocks:
                    dropped += len(self._drop(t, h))
            index.counters["damaged"] += len(bad)
            empty = [s.name for s in index.sessions.values() if not s.pinned and index.present_blocks(s) == 0]
            for name in empty:
                index.remove_session(name)
            for s in list(index.sessions.values()):
                if s.logits is not None and not self.files.blob_sound(s.logits):
                    index.set_session(dataclasses.replace(s, logits=None))
            evicted = self._evict(t)
            keep = {self.files.block_path(h) for h in index.blocks} | {
                self.files.blob_path(s.logits) for s in index.sessions.values() if s.logits is not None
            }
            orphans = 0
            for p in self.files.walk():
                if p.suffix in (".blk", ".f32") and p not in keep and p not in t.doomed:
                    t.doomed.append(p)
                    orphans += 1
            return GcReport(temp_files, orphans, dropped, len(empty), len(evicted))

    def check(self) -> list[str]:
        """Problems found reading the whole store (empty when sound): index invariants, every block's file
        present and passing its checksum, every session's logits present."""
        with self._txn(write=False) as t:
            problems = t.index.check()
            for record in t.index.blocks.values():
                try:
                    self.files.read_block(record)
                except StoreError as exc:
                    problems.append(str(exc))
            for s in t.index.sessions.values():
                if s.logits is not None and not self.files.blob_sound(s.logits):
                    problems.append(f"session {s.name!r}: last-position logits are missing or damaged")
            return problems

    def read_session(self, name: str) -> tuple[ChainInfo, SessionRecord, list[StoredBlock], bytes | None]:
        """Session ``name`` whole, in one transaction: its chain, record, every block (checked) and
        its logits; ``StoreError`` if a block is gone or damaged."""
        with self._txn(write=False) as t:
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

    # -- .kv interchange (see kvsnap.store.interchange) ---------------------------------------------

    def session_export(self, name: str) -> SessionExport:
        """What ``write_snapshot`` needs to write session ``name``; ``StoreError`` if a block is gone or damaged."""
        from kvsnap.store.interchange import session_export

        return session_export(self, name)

    def export_session(self, name: str, path: str | os.PathLike[str]) -> int:
        """Write session ``name`` as a ``.kv`` snapshot (atomically); returns the file size."""
        return self.session_export(name).write(path)

    def import_snapshot(
        self, path: str | os.PathLike[str], name: str | None = None, *, pin: bool | None = None
    ) -> PutResult:
        """Add a ``.kv`` file's blocks (verified, not re-encoded) and record it as session ``name``
        (default: the file name without ``.kv``), with its chat messages and last-position logits."""
        from kvsnap.store.interchange import import_snapshot

        return import_snapshot(self, path, name, pin=pin)

    # -- internals -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _txn(self, write: bool) -> Iterator[_Txn]:
        """One transaction: the lock, a freshly loaded index and, for writers, the index written back."""
        with self.files.lock(exclusive=write):
            t = _Txn(self.files.load_index())
            yield t
            if write:
                for folder in t.dirs:
                    fsync_dir(folder)
                self.files.save_index(t.index)
                fsync_dir(self.path)
                # Only now that the index no longer names them.
                for p in t.doomed:
                    with contextlib.suppress(OSError):
                        p.unlink()

    def _put(
        self,
        t: _Txn,
        chain: ChainInfo,
        token_ids: Sequence[int],
        blocks: Sequence[EncodedBlock | None],
        codec: str,
        level: int,
        with_tail: bool,
    ) -> tuple[list[bytes], int, int]:
        if codec not in codecs.CODECS:
            raise ConfigError(f"unknown codec {codec!r} (known: {', '.join(codecs.CODECS)})")
        bs = chain.block_size
        keys = block_keys(token_ids, bs, chain.root)
        num_full = len(token_ids) // bs
        if len(blocks) not in (num_full, len(keys)):
            raise ValueError(f"{len(blocks)} blocks given for {len(token_ids)} tokens in blocks of {bs}")
        index = t.index
        index.add_chain(chain)
        stored: list[bytes] = []
        new = reused = 0
        parent = chain.root
        for i, (h, block) in enumerate(zip(keys, blocks)):
            tokens = tuple(int(x) for x in token_ids[i * bs : (i + 1) * bs])
            full = len(tokens) == bs
            if not full and not with_tail:
                break
            known = index.blocks.get(h)
            if block is not None:
                check_block(i, block, h if full else None, len(tokens) * chain.layout.bytes_per_token)
            if known is not None:
                # Dedup; put() refuses a hash stored for other tokens (a collision).
                index.put(dataclasses.replace(known, parent=parent, root=chain.root, token_ids=tokens))
                reused += 1
            elif block is None:
                break  # evicted since the caller looked: keep the blocks before the gap
            else:
                record = BlockRecord(
                    h,
                    parent,
                    chain.root,
                    tokens,
                    full,
                    block.raw_bytes,
                    len(block.stored),
                    block.checksum,
                    codec,
                    level,
                )
                self._write(t, self.files.block_path(h), block.stored)
                index.put(record)
                new += 1
            stored.append(h)
            parent = h
        return stored, new, reused

    @staticmethod
    def _result(index: BlockIndex, hashes: list[bytes], new: int, reused: int, evicted: list[bytes]) -> PutResult:
        kept = []
        for h in hashes:
            if h not in index.blocks:
                break
            kept.append(h)
        tokens = sum(len(index.blocks[h].token_ids) for h in kept)
        return PutResult(tuple(kept), tokens, new, reused, tuple(evicted))

    @staticmethod
    def _session(index: BlockIndex, name: str) -> SessionRecord:
        session = index.sessions.get(name)
        if session is None:
            raise StoreError(f"no session {name!r} in the store")
        return session

    def _evict(self, t: _Txn) -> list[bytes]:
        evicted = t.index.evict()
        t.doomed.extend(self.files.block_path(h) for h in evicted)
        return evicted

    def _drop(self, t: _Txn, h: bytes) -> list[bytes]:
        dropped = t.index.remove_subtree(h)
        t.doomed.extend(self.files.block_path(x) for x in dropped)
        return dropped

    def _forget_blob(self, t: _Txn, blob_id: str | None) -> None:
        if blob_id is not None and all(s.logits != blob_id for s in t.index.sessions.values()):
            t.doomed.append(self.files.blob_path(blob_id))

    def _write(self, t: _Txn, path: Path, data: bytes | memoryview) -> None:
        write_file(path, data)
        t.dirs.add(path.parent)
