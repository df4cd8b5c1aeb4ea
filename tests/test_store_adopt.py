"""A writer killed mid-transaction: the block files it completed are adopted (proven by their
trailers) at the next lookup, so the next identical request reuses them; what it left half-written
is named by ``check`` and removed by ``gc``."""

from __future__ import annotations

import os
import tempfile

import pytest
from test_store import make_blocks, make_chain, put

from kvsnap.store import BlockStore
from kvsnap.store.files import StoreFiles

TOKENS = list(range(100, 116))  # four blocks of four


class Killed(BaseException):
    """The process dies here: nothing after it runs, no handler cleans up."""


@pytest.fixture
def killed_index_write(monkeypatch):
    """``arm()``: the next index write that names a block dies before it reaches the disk."""
    real = StoreFiles.save_index
    armed = []

    def save_index(self, index):
        if armed and index.blocks:
            armed.clear()
            raise Killed()
        return real(self, index)

    monkeypatch.setattr(StoreFiles, "save_index", save_index)
    return lambda: armed.append(True)


def test_blocks_a_killed_writer_completed_are_adopted_at_the_next_lookup(tmp_path, killed_index_write):
    chain = make_chain()
    store = BlockStore(tmp_path / "store")
    put(store, chain, TOKENS[:8])  # two blocks indexed
    killed_index_write()
    with pytest.raises(Killed):
        put(store, chain, TOKENS)  # four block files written, the index never names the last two
    assert len(BlockStore(tmp_path / "store").read_index().blocks) == 2

    again = BlockStore(tmp_path / "store")
    match, blocks = again.fetch(TOKENS, chain.root, chain.block_size)
    assert match.full_blocks == 4 and match.hit_tokens == 16 and not match.dropped
    assert [b.data for b in blocks] == [b.stored for b in make_blocks(chain, TOKENS)]
    assert len(BlockStore(tmp_path / "store").read_index().blocks) == 4  # the adoption was saved
    assert again.check() == []


def test_a_block_file_that_cannot_prove_itself_is_not_adopted_and_says_why(tmp_path, killed_index_write):
    chain = make_chain()
    store = BlockStore(tmp_path / "store")
    killed_index_write()
    with pytest.raises(Killed):
        put(store, chain, TOKENS)
    blocks_dir = tmp_path / "store" / "blocks"
    files = sorted(p for p in blocks_dir.rglob("*.blk"))
    assert len(files) == 4 and BlockStore(tmp_path / "store").read_index().blocks == {}
    victim = StoreFiles(tmp_path / "store").block_path(make_blocks(chain, TOKENS)[2].hash)
    data = bytearray(victim.read_bytes())
    data[3] ^= 0xFF  # a stored byte: the trailer's checksum no longer holds
    victim.write_bytes(bytes(data))

    match, _ = BlockStore(tmp_path / "store").fetch(TOKENS, chain.root, chain.block_size)
    assert match.full_blocks == 2  # adopted up to the damaged file, not past it
    assert len(match.dropped) == 1 and "not adopted" in match.dropped[0] and str(victim) in match.dropped[0]
    report = BlockStore(tmp_path / "store").gc()
    assert not victim.exists() and report.orphan_files >= 2  # it, and the block after it


def test_a_killed_writers_temp_file_is_named_by_check_and_removed_by_gc(tmp_path):
    chain = make_chain()
    store = BlockStore(tmp_path / "store")
    put(store, chain, TOKENS[:8])
    h = make_blocks(chain, TOKENS)[2].hash.hex()
    folder = tmp_path / "store" / "blocks" / h[:2]
    folder.mkdir(exist_ok=True)
    # The name format.atomic.replace_whole gives its temp file, as a SIGKILL leaves it.
    fd, temp = tempfile.mkstemp(prefix=f".{h}.blk.", suffix=".tmp", dir=folder)
    os.write(fd, b"half a block")
    os.close(fd)
    problems = store.check()
    assert len(problems) == 1 and "temp file a killed writer left" in problems[0], problems
    assert store.gc().temp_files == 1 and not os.path.exists(temp)
    assert store.check() == []


def test_the_next_identical_request_after_a_kill_reuses_what_was_written(llama, tmp_path, killed_index_write):
    from kvsnap.config import SessionConfig
    from kvsnap.serve import CHAT, Service, parse_request

    config = SessionConfig(block_size=16, chunk_size=32)
    text = "Blocks of tokens are hashed in a chain, so a prefix is found by its last block alone. " * 3
    raw = f'{{"messages": [{{"role": "user", "content": "{text}"}}], "max_tokens": 2, "temperature": 0}}'
    req = parse_request(raw.encode(), CHAT)
    killed_index_write()
    with pytest.raises(Killed):  # the server is killed while it stores the answer's blocks
        Service(llama, config, BlockStore(tmp_path / "store")).complete(req)
    restarted = Service(llama, config, BlockStore(tmp_path / "store"))
    done = restarted.complete(req)
    assert done.restored_from == "store" and done.cached_tokens >= done.prompt_tokens // 16 * 16 - 16 > 0
