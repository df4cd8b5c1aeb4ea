"""A directory of KV blocks shared by many sessions: content-addressed, deduplicated, under a budget.

    DIR/index.json              the BlockIndex (kvsnap/blockindex.py) as JSON, written atomically
    DIR/.lock                   fcntl lock file: writers exclusive, readers shared
    DIR/blocks/ab/<hash>.blk    one block's stored (encoded) bytes, named by its chained hash
    DIR/blobs/ab/<id>.f32       a session's last-position logits, named by their BLAKE2b digest

A block is stored once however many sessions use it. Every change runs under the exclusive lock:
load the index, write new files (temp file, fsync, rename), write the index, and only then delete
the files of evicted blocks. A crash leaves at worst unreferenced files, which ``gc`` removes; the
index never names a file that was not written first. Every block read is checked against its
checksum, and a damaged block is never used: ``get`` refuses it with ``StoreError``, ``fetch``
treats it as a miss and drops it with the blocks below it.

The budget bounds the stored bytes of blocks. Session records (token ids, chat messages, logits)
are small and are not evicted; blocks of pinned sessions are kept even beyond the budget.
No torch here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvsnap import codec as codecs
from kvsnap.atomic import fsync_dir, replace_whole
from kvsnap.blockindex import (
    BlockIndex,
    BlockRecord,
    ChainInfo,
    SessionRecord,
    StoreError,
    StoreMatch,
    block_keys,
)
from kvsnap.errors import ConfigError
from kvsnap.snapshot import EncodedBlock, KVLayout, Snapshot, checksum, encode_block, write_snapshot

__all__ = [
    "BlockRecord",
    "BlockStore",
    "ChainInfo",
    "GcReport",
    "PutResult",
    "SessionExport",
    "SessionRecord",
    "StoreError",
    "StoreMatch",
    "StoredBlock",
    "parse_size",
]

INDEX_NAME = "index.json"
LOCK_NAME = ".lock"
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_size(value: str | int) -> int:
    """``"200MB"``, ``"2GB"``, ``"1.5GiB"`` or a plain byte count -> bytes; ``ConfigError`` otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ConfigError(f"size {value} is negative")
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*", str(value), flags=re.IGNORECASE)
    if m is None:
        raise ConfigError(f"cannot read {value!r} as a size (examples: 200MB, 2GB, 1048576)")
    number, unit, binary = m.groups()
    scale = 1024 ** "kmgt".index(unit.lower()) * 1024 if binary and unit else _UNITS[unit.lower()]
    return int(float(number) * scale)


@dataclass(frozen=True, slots=True)
class PutResult:
    """What a ``put``, ``add_session`` or ``import_snapshot`` left in the store."""

    hashes: tuple[bytes, ...]  # the chain's blocks stored after the call, from the first
    stored_tokens: int  # tokens those blocks cover
    new_blocks: int  # written by this call
    reused_blocks: int  # already stored (deduplicated)
    evicted: tuple[bytes, ...]  # evicted to fit the budget, in order


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """A block read from the store, checksum verified."""

    record: BlockRecord
    data: bytes  # the stored (encoded) bytes

    def encoded(self) -> EncodedBlock:
        """As a snapshot block (what ``Session`` keeps so its next save does not encode it again)."""
        r = self.record
        return EncodedBlock(len(r.token_ids), r.hash if r.full else None, r.raw_bytes, self.data, r.checksum)

    def decode(self, itemsize: int, out: np.ndarray | None = None) -> bytes | bytearray | np.ndarray:
        """The block's raw KV bytes, ``[layers, 2, kv_heads, tokens, head_dim]`` (see ``codec.decode`` for ``out``)."""
        r = self.record
        try:
            return codecs.decode(self.data, r.raw_bytes, itemsize, r.codec, out)
        except codecs.CodecError as exc:
            raise StoreError(f"block {r.hash.hex()[:12]} does not decode ({exc})") from None


@dataclass(frozen=True, slots=True)
class SessionExport:
    """Everything ``write_snapshot`` needs to write a stored session as a ``.kv`` file."""

    model: str
    fingerprint: str
    root: bytes
    layout: KVLayout
    block_size: int
    codec: str
    level: int
    tokens: tuple[int, ...]
    blocks: tuple[EncodedBlock, ...]
    last_logits: np.ndarray | None
    messages: tuple[dict[str, str], ...] | None
    extra: dict[str, Any]

    def write(self, path: str | os.PathLike[str]) -> int:
        """Write the ``.kv`` file atomically; returns its size."""
        return write_snapshot(
            path,
            model=self.model,
            fingerprint=self.fingerprint,
            root=self.root,
            layout=self.layout,
            block_size=self.block_size,
            codec=self.codec,
            level=self.level,
            tokens=self.tokens,
            blocks=self.blocks,
            last_logits=self.last_logits,
            messages=self.messages,
            extra=self.extra,
        )


@dataclass(frozen=True, slots=True)
class GcReport:
    temp_files: int  # left by crashed writers
    orphan_files: int  # block or logits files the index does not name
    dropped_blocks: int  # missing or damaged, with the blocks below them
    dropped_sessions: int  # unpinned sessions none of whose blocks are left
    evicted: int  # to fit the budget


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
        self._index_path = self.path / INDEX_NAME
        if not create and not self._index_path.is_file():
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
                    data = self._read_block(record)
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
            return self._read_block(record)

    # -- writing ---------------------------------------------------------------------------------

    def put(
        self,
        chain: ChainInfo,
        token_ids: Sequence[int],
        blocks: Sequence[EncodedBlock | None],
        *,
        codec: str,
        level: int = codecs.DEFAULT_LEVEL,
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
        level: int = codecs.DEFAULT_LEVEL,
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
                logits_id = hashlib.blake2b(logits, digest_size=16).hexdigest()
                path = self._blob_path(logits_id)
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
            for p in self._walk():
                # Under the exclusive lock no writer is active: a temp file is a crash's leftover.
                if p.name.startswith(".") and p.name.endswith(".tmp"):
                    with contextlib.suppress(OSError):
                        p.unlink()
                        temp_files += 1
            bad = [h for h, r in index.blocks.items() if not self._sound(r, verify)]
            dropped = 0
            for h in bad:
                if h in index.blocks:
                    dropped += len(self._drop(t, h))
            index.counters["damaged"] += len(bad)
            empty = [s.name for s in index.sessions.values() if not s.pinned and index.present_blocks(s) == 0]
            for name in empty:
                index.remove_session(name)
            for s in list(index.sessions.values()):
                if s.logits is not None and not self._blob_sound(s.logits):
                    index.set_session(dataclasses.replace(s, logits=None))
            evicted = self._evict(t)
            keep = {self._block_path(h) for h in index.blocks} | {
                self._blob_path(s.logits) for s in index.sessions.values() if s.logits is not None
            }
            orphans = 0
            for p in self._walk():
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
                    self._read_block(record)
                except StoreError as exc:
                    problems.append(str(exc))
            for s in t.index.sessions.values():
                if s.logits is not None and not self._blob_sound(s.logits):
                    problems.append(f"session {s.name!r}: last-position logits are missing or damaged")
            return problems

    # -- .kv interchange --------------------------------------------------------------------------

    def session_export(self, name: str) -> SessionExport:
        """What ``write_snapshot`` needs to write session ``name``; ``StoreError`` if a block is gone or damaged.

        Blocks stored with another codec than the session's first block are re-encoded to it (a
        ``.kv`` file names one codec).
        """
        with self._txn(write=False) as t:
            index = t.index
            session = self._session(index, name)
            present = index.present_blocks(session)
            if present < len(session.hashes):
                raise StoreError(
                    f"session {name!r} lost {len(session.hashes) - present} of its {len(session.hashes)} blocks "
                    "to eviction (pin a session to keep it whole)"
                )
            chain = index.chains[session.root]
            records = [index.blocks[h] for h in session.hashes]
            datas = [self._read_block(r) for r in records]
            logits = self._read_blob(session.logits) if session.logits is not None else None
        codec, level = records[0].codec, records[0].level
        blocks = []
        for record, data in zip(records, datas):
            block = StoredBlock(record, data)
            if record.codec != codec:
                raw = block.decode(chain.layout.itemsize)
                h = record.hash if record.full else None
                blocks.append(encode_block(raw, len(record.token_ids), h, chain.layout.itemsize, codec, level))
            else:
                blocks.append(block.encoded())
        return SessionExport(
            model=chain.model,
            fingerprint=chain.fingerprint,
            root=chain.root,
            layout=chain.layout,
            block_size=chain.block_size,
            codec=codec,
            level=level,
            tokens=session.token_ids,
            blocks=tuple(blocks),
            last_logits=np.frombuffer(logits, dtype="<f4").copy() if logits is not None else None,
            messages=session.messages,
            extra=dict(session.extra),
        )

    def export_session(self, name: str, path: str | os.PathLike[str]) -> int:
        """Write session ``name`` as a ``.kv`` snapshot (atomically); returns the file size."""
        return self.session_export(name).write(path)

    def import_snapshot(
        self, path: str | os.PathLike[str], name: str | None = None, *, pin: bool | None = None
    ) -> PutResult:
        """Add a ``.kv`` file's blocks (verified, not re-encoded) and record it as session ``name``
        (default: the file name without ``.kv``), with its chat messages and last-position logits."""
        with Snapshot(path) as snap:
            meta = snap.meta
            # Copies: the snapshot's map closes with the file.
            blocks = [snap.encoded_block(i, bytes(snap.read_stored(i))) for i in range(len(meta.blocks))]
            logits = snap.last_logits()
            tokens = list(snap.tokens)
        chain = ChainInfo(meta.root, meta.model, meta.fingerprint, meta.layout, meta.block_size)
        return self.add_session(
            name if name is not None else Path(path).stem,
            chain,
            tokens,
            blocks,
            codec=meta.codec,
            level=meta.level,
            pin=pin,
            messages=meta.messages,
            last_logits=logits,
            extra=meta.extra,
        )

    # -- internals -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _txn(self, write: bool) -> Iterator[_Txn]:
        """One transaction: the lock, a freshly loaded index and, for writers, the index written back."""
        with _flock(self.path / LOCK_NAME, exclusive=write):
            t = _Txn(self._load())
            yield t
            if write:
                for folder in t.dirs:
                    fsync_dir(folder)
                data = json.dumps(t.index.to_json(), separators=(",", ":"), ensure_ascii=True).encode()
                _write_file(self._index_path, data)
                fsync_dir(self.path)
                # Only now that the index no longer names them.
                for p in t.doomed:
                    with contextlib.suppress(OSError):
                        p.unlink()

    def _load(self) -> BlockIndex:
        try:
            text = self._index_path.read_bytes()
        except FileNotFoundError:
            return BlockIndex()
        except OSError as exc:
            raise StoreError(f"{self._index_path}: cannot read ({exc.strerror or exc})") from None
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):
            raise StoreError(f"{self._index_path}: store index is not valid JSON (damaged?)") from None
        try:
            return BlockIndex.from_json(data)
        except StoreError as exc:
            raise StoreError(f"{self._index_path}: {exc}") from None

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
                _check_block(i, block, h if full else None, len(tokens) * chain.layout.bytes_per_token)
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
                self._write(t, self._block_path(h), block.stored)
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
        t.doomed.extend(self._block_path(h) for h in evicted)
        return evicted

    def _drop(self, t: _Txn, h: bytes) -> list[bytes]:
        dropped = t.index.remove_subtree(h)
        t.doomed.extend(self._block_path(x) for x in dropped)
        return dropped

    def _forget_blob(self, t: _Txn, blob_id: str | None) -> None:
        if blob_id is not None and all(s.logits != blob_id for s in t.index.sessions.values()):
            t.doomed.append(self._blob_path(blob_id))

    def _write(self, t: _Txn, path: Path, data: bytes | memoryview) -> None:
        _write_file(path, data)
        t.dirs.add(path.parent)

    def _block_path(self, h: bytes) -> Path:
        name = h.hex()
        return self.path / "blocks" / name[:2] / f"{name}.blk"

    def _blob_path(self, blob_id: str) -> Path:
        if not re.fullmatch(r"[0-9a-f]{32}", blob_id):
            raise StoreError(f"invalid logits id {blob_id!r} in the store index")
        return self.path / "blobs" / blob_id[:2] / f"{blob_id}.f32"

    def _read_block(self, record: BlockRecord) -> bytes:
        path = self._block_path(record.hash)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise StoreError(f"{path}: block file is missing") from None
        except OSError as exc:
            raise StoreError(f"{path}: cannot read ({exc.strerror or exc})") from None
        if len(data) != record.stored_bytes or checksum(data) != record.checksum:
            raise StoreError(f"{path}: block is damaged (checksum mismatch)")
        return data

    def _read_blob(self, blob_id: str) -> bytes:
        path = self._blob_path(blob_id)
        try:
            data = path.read_bytes()
        except OSError:
            raise StoreError(f"{path}: last-position logits are missing") from None
        if hashlib.blake2b(data, digest_size=16).hexdigest() != blob_id:
            raise StoreError(f"{path}: last-position logits are damaged")
        return data

    def _sound(self, record: BlockRecord, verify: bool) -> bool:
        if verify:
            try:
                self._read_block(record)
            except StoreError:
                return False
            return True
        try:
            return self._block_path(record.hash).stat().st_size == record.stored_bytes
        except OSError:
            return False

    def _blob_sound(self, blob_id: str) -> bool:
        try:
            self._read_blob(blob_id)
        except StoreError:
            return False
        return True

    def _walk(self) -> Iterator[Path]:
        for folder in (self.path, self.path / "blocks", self.path / "blobs"):
            if not folder.is_dir():
                continue
            for dirpath, _, filenames in os.walk(folder):
                for name in filenames:
                    yield Path(dirpath) / name
                if folder == self.path:
                    break  # the top folder only: its subfolders are walked on their own


def _check_block(i: int, block: EncodedBlock, hash_: bytes | None, raw_bytes: int) -> None:
    """A caller's block must be the block of these tokens: a mismatch is a bug, never stored."""
    if block.hash != hash_:
        raise ValueError(f"block {i}: its hash does not match the token ids")
    if block.raw_bytes != raw_bytes:
        raise ValueError(f"block {i}: {block.raw_bytes} raw bytes, expected {raw_bytes}")
    if checksum(block.stored) != block.checksum:
        raise StoreError(f"block {i}: stored bytes do not match their checksum (changed since encoded?)")


def _write_file(path: Path, data: bytes | memoryview) -> None:
    """Write ``path`` whole or not at all (the store's own lock orders its writers)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_whole(path, [data])
    except OSError as exc:
        # The transaction ends without writing the index: the store is as it was (gc removes new files).
        raise StoreError(f"{path}: cannot write ({exc.strerror or exc})") from None


@contextlib.contextmanager
def _flock(path: Path, exclusive: bool) -> Iterator[None]:
    """An advisory fcntl lock on the store's lock file: exclusive for writers, shared for readers."""
    try:
        import fcntl
    except ImportError:  # no fcntl (Windows): atomic renames still keep every file whole
        yield
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise StoreError(f"{path}: cannot open the store's lock file ({exc.strerror or exc})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # closing releases the lock
