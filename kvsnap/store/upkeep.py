"""Looking after a block store: ``check`` (read what a run reads), ``gc`` (tidy) and ``repair`` (rebuild
the index from the block files). ``BlockStore`` calls these; no torch here.

What each may delete: ``check`` nothing; ``gc`` only names kvsnap writes (block and logits files
the index does not name, kvsnap's own temp files, an empty folder at a block's name); ``repair``
nothing at all (an unreadable index is kept as ``index.damaged.json``). Everything else in the
folder is reported, never deleted.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from kvsnap import hashing
from kvsnap.errors import StoreError
from kvsnap.format.atomic import fsync_dir
from kvsnap.store import blockfile
from kvsnap.store.files import DAMAGED_INDEX_NAME, REPAIR_HINT, StoreFiles
from kvsnap.store.folder import remove_own, scan
from kvsnap.store.index import BlockIndex
from kvsnap.store.records import BlockRecord, GcReport, RepairReport, StoredBlock, record_problem

if TYPE_CHECKING:
    from kvsnap.store.txn import Txn


def block_problem(files: StoreFiles, index: BlockIndex, record: BlockRecord, verify: bool = True) -> str | None:
    """Why a run could not use this block (None when it can). With ``verify``, everything a run does
    to it: read, checksum, trailer, decode; without, only that its entry holds and its file is there."""
    path = files.block_path(record.hash)
    chain = index.chains.get(record.root)
    problem = record_problem(record, chain)
    if problem is not None:
        return f"{path}: index entry is damaged ({problem})"
    assert chain is not None
    if not verify:
        try:
            st = os.lstat(path)
        except OSError:
            return f"{path}: block file is missing"
        return None if stat.S_ISREG(st.st_mode) and st.st_size >= record.stored_bytes else f"{path}: block is damaged"
    try:
        StoredBlock(record, files.read_block(record)).decode(chain.layout.itemsize)
    except StoreError as exc:
        text = str(exc)
        return text if text.startswith(str(path)) else f"{path}: {text}"
    return None


def gc(files: StoreFiles, transaction: Callable[[bool], AbstractContextManager[Txn]], verify: bool) -> GcReport:
    # Loading refuses a missing index while block files are here: gc never takes a lost index for an
    # empty store (it would delete every block as an orphan).
    with transaction(True) as t:
        index = t.index
        entries = scan(files.root)
        # Under the exclusive lock no writer is active: kvsnap's temp files are a crash's leftovers.
        temp_files = sum(remove_own(e.path) for e in entries if e.kind == "temp")
        bad = [h for h, r in index.blocks.items() if block_problem(files, index, r, verify)]
        dropped = 0
        for h in bad:
            if h in index.blocks:
                dropped += len(t.drop_subtree(files, h))
        index.counters["damaged"] += len(bad)
        empty = [s.name for s in index.sessions.values() if not s.pinned and index.present_blocks(s) == 0]
        for name in empty:
            index.remove_session(name)
        for s in list(index.sessions.values()):
            if s.logits is not None and not files.blob_sound(s.logits):
                index.set_session(dataclasses.replace(s, logits=None))
        evicted = t.evict(files)
        keep = {files.block_path(h) for h in index.blocks} | {
            files.blob_path(s.logits) for s in index.sessions.values() if s.logits is not None
        }
        orphans = 0
        for e in entries:
            if e.kind in ("block", "blob", "folder") and e.path not in keep and e.path not in t.doomed:
                t.doomed.append(e.path)
                orphans += 1
        unknown = tuple(e.rel for e in entries if e.kind == "unknown")
        return GcReport(temp_files, orphans, dropped, len(empty), len(evicted), unknown)


def check(files: StoreFiles) -> list[str]:
    with files.lock(exclusive=False):
        try:
            index = files.load_index()
        except StoreError as exc:
            return [str(exc)]
        problems = index.check()
        reported = set()
        for record in index.blocks.values():
            problem = block_problem(files, index, record)
            if problem is not None:
                problems.append(problem)
                reported.add(files.block_path(record.hash))
        for s in index.sessions.values():
            if s.logits is not None and not files.blob_sound(s.logits):
                problems.append(f"session {s.name!r}: last-position logits are missing or damaged")
        for e in scan(files.root):
            if e.path in reported:
                continue  # named above, as the block it stands in for
            if e.kind == "unknown":
                problems.append(f"{e.rel}: not a file kvsnap writes (gc leaves it alone)")
            elif e.kind == "folder":
                problems.append(f"{e.rel}: a folder where a block belongs (gc removes it while empty)")
            elif e.kind == "temp":
                # Under the shared lock no writer is at work: it is a killed writer's half-written file.
                problems.append(f"{e.rel}: a temp file a killed writer left (gc removes it)")
        return problems


def adopt_following(
    files: StoreFiles,
    index: BlockIndex,
    prompt_ids: Sequence[int],
    root: bytes,
    block_size: int,
    matched: Sequence[bytes],
) -> tuple[list[bytes], list[str]]:
    """The prompt's blocks after those ``matched`` in the index that a writer killed before its index write
    left complete on disk, adopted into ``index`` (it must be saved): each file's trailer must name
    the block the prompt needs there and prove it (``blockfile.prove``). Returns the hashes adopted,
    in order, and one line for a file found there that could not be (then the match ends there).
    Costs one ``lstat`` when nothing is there to adopt."""
    adopted: list[bytes] = []
    parent = matched[-1] if matched else root
    for i in range(len(matched), len(prompt_ids) // block_size):
        tokens = tuple(int(t) for t in prompt_ids[i * block_size : (i + 1) * block_size])
        h = hashing.block_hash(parent, tokens)
        path = files.block_path(h)
        if h in index.blocks or not os.path.lexists(path):
            break
        try:
            record, chain, stored = files.read_block_file(path)
            if (record.hash, record.parent, record.root, record.token_ids) != (h, parent, root, tokens):
                raise StoreError("its trailer names another block")
            if not record.full or chain.block_size != block_size:
                raise StoreError("its trailer names a block of another size")
            blockfile.prove(record, chain, stored)
            index.add_chain(chain)
            index.put(record)
        except (StoreError, OSError) as exc:
            why = getattr(exc, "strerror", None) or exc
            return adopted, [f"{path}: a block file the index does not name, not adopted: {why} (gc removes it)"]
        adopted.append(h)
        parent = h
    return adopted, []


def repair(files: StoreFiles) -> RepairReport:
    with files.lock(exclusive=True):
        damaged_index = None
        try:
            index = files.load_index()
            state = "sound"
        except StoreError as exc:
            index = BlockIndex()
            state = "missing"
            if os.path.lexists(files.index_path):
                state = str(exc).removesuffix(f"; {REPAIR_HINT}")
                # Kept, not deleted: what it held beyond the blocks (sessions, pins, budget) may matter to someone.
                kept = files.root / DAMAGED_INDEX_NAME
                try:
                    os.replace(files.index_path, kept)
                    damaged_index = str(kept)
                except OSError as err:
                    raise StoreError(f"{files.index_path}: cannot move aside ({err.strerror or err})") from None
        dropped = 0
        for h in list(index.blocks):
            if h in index.blocks and block_problem(files, index, index.blocks[h]) is not None:
                dropped += len(index.remove_subtree(h))
        kept_blocks = len(index.blocks)
        entries = scan(files.root)
        unproven, candidates = _candidates(files, index, [e for e in entries if e.kind == "block"])
        recovered = _adopt(index, candidates, unproven)
        for s in list(index.sessions.values()):
            if s.logits is not None and not files.blob_sound(s.logits):
                index.set_session(dataclasses.replace(s, logits=None))
        index.counters["damaged"] += dropped
        files.save_index(index)
        fsync_dir(files.root)
        unknown = tuple(e.rel for e in entries if e.kind == "unknown")
        return RepairReport(state, kept_blocks, recovered, dropped, tuple(sorted(unproven)), unknown, damaged_index)


def _candidates(files: StoreFiles, index: BlockIndex, entries: list) -> tuple[list[str], list]:
    """Block files the index does not name, each proven from its trailer, oldest first."""
    unproven, found = [], []
    named = {files.block_path(h) for h in index.blocks}
    for e in entries:
        if e.path in named:
            continue
        try:
            record, chain, stored = files.read_block_file(e.path)
            if files.block_path(record.hash) != e.path:
                raise StoreError("its trailer names another block")
            blockfile.prove(record, chain, stored)
            mtime = os.lstat(e.path).st_mtime_ns
        except (StoreError, OSError) as exc:
            unproven.append(f"{e.rel}: {exc}")
            continue
        found.append((mtime, e.rel, record, chain))
    found.sort(key=lambda c: (c[0], c[1]))
    return unproven, found


def _adopt(index: BlockIndex, candidates: list, unproven: list[str]) -> int:
    """Add proven blocks parents first (in file age order, so the oldest are evicted first)."""
    added = 0
    pending = candidates
    while pending:
        rest = []
        for c in pending:
            _, rel, record, chain = c
            parent = index.blocks.get(record.parent)
            if record.parent != record.root and (parent is None or not parent.full):
                rest.append(c)
                continue
            try:
                index.add_chain(chain)
                index.put(record)
            except StoreError as exc:
                unproven.append(f"{rel}: {exc}")
                continue
            added += 1
        if len(rest) == len(pending):
            unproven.extend(f"{c[1]}: its parent block is not in the store" for c in rest)
            break
        pending = rest
    return added
