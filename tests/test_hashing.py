"""Chained block hashes: what a block's identity depends on, and that it is stable everywhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from core_helpers import FINGERPRINT, NAMESPACE

from kvsnap import hashing

TOKENS = list(range(100, 130))  # 30 tokens: 7 full blocks of 4 and a partial tail of 2


def _root(fingerprint: str = FINGERPRINT, namespace: str = NAMESPACE, block_size: int = 4) -> bytes:
    return hashing.chain_root(fingerprint, namespace, block_size)


def test_digest_is_16_bytes():
    root = _root()
    hashes = hashing.chain_hashes(TOKENS, 4, root)
    assert hashing.DIGEST_SIZE == 16
    assert len(root) == 16
    assert hashes and all(isinstance(h, bytes) and len(h) == 16 for h in hashes)


@pytest.mark.parametrize(
    ("num_tokens", "block_size", "num_hashes"),
    [(0, 4, 0), (3, 4, 0), (4, 4, 1), (7, 4, 1), (8, 4, 2), (30, 4, 7), (5, 1, 5), (15, 16, 0)],
)
def test_only_full_blocks_have_a_hash(num_tokens, block_size, num_hashes):
    """A partial tail block has no hash: it may still grow, so it has no identity yet."""
    assert len(hashing.chain_hashes(TOKENS[:num_tokens], block_size, _root(block_size=block_size))) == num_hashes


def test_tail_tokens_do_not_change_full_block_hashes():
    root = _root()
    full = hashing.chain_hashes(TOKENS[:28], 4, root)
    assert hashing.chain_hashes(TOKENS[:30], 4, root) == full
    assert hashing.chain_hashes(TOKENS[:28] + [7, 7, 7], 4, root) == full


def test_chain_depends_on_fingerprint_namespace_and_block_size():
    roots = {
        _root(),
        _root(fingerprint=FINGERPRINT + "x"),
        _root(namespace="other"),
        _root(block_size=8),
    }
    assert len(roots) == 4
    chains = {tuple(hashing.chain_hashes(TOKENS, 4, root)) for root in roots}
    assert len(chains) == 4
    # Not even one block of one chain may equal a block of another.
    all_hashes = [h for chain in chains for h in chain]
    assert len(set(all_hashes)) == len(all_hashes)


def test_root_fields_are_length_prefixed():
    """Guards an ambiguous concatenation: ("ab", "c") and ("a", "bc") must not share a root."""
    assert hashing.chain_root("ab", "c", 4) != hashing.chain_root("a", "bc", 4)
    assert hashing.chain_root("fp", "", 4) != hashing.chain_root("", "fp", 4)


def test_chain_depends_on_position():
    """The same tokens in another block position hash differently: position is baked in."""
    block = [5, 6, 7, 8]
    hashes = hashing.chain_hashes(block * 3, 4, _root())
    assert len(set(hashes)) == 3


def test_a_change_in_one_block_changes_every_later_hash():
    root = _root()
    base = hashing.chain_hashes(TOKENS, 4, root)
    changed = list(TOKENS)
    changed[9] += 1  # block 2
    other = hashing.chain_hashes(changed, 4, root)
    assert other[:2] == base[:2]
    assert all(a != b for a, b in zip(base[2:], other[2:]))


def test_block_size_partitions_differently_under_the_same_root():
    root = _root()
    assert hashing.chain_hashes(TOKENS[:8], 4, root)[-1] != hashing.chain_hashes(TOKENS[:8], 8, root)[-1]


def test_token_bytes_are_little_endian_int32():
    assert hashing.token_bytes([1, -1, 2**31 - 1]) == (b"\x01\x00\x00\x00" + b"\xff\xff\xff\xff" + b"\xff\xff\xff\x7f")
    ids = [0, 1, 255, 256, 65_535, 151_935, 2**31 - 1, -(2**31)]
    assert hashing.tokens_from_bytes(hashing.token_bytes(ids)) == ids
    assert hashing.token_bytes([]) == b""


def test_token_ids_hash_by_value_not_by_type():
    """A list, a tuple and numpy arrays of int64 or int32 are the same token ids and must hash the same."""
    root = _root()
    ref = hashing.chain_hashes(TOKENS, 4, root)
    assert hashing.chain_hashes(tuple(TOKENS), 4, root) == ref
    assert hashing.chain_hashes(np.array(TOKENS, dtype=np.int64), 4, root) == ref
    assert hashing.chain_hashes(np.array(TOKENS, dtype=np.int32), 4, root) == ref


def test_hash_scheme_is_frozen():
    """Snapshots already on disk must keep matching: a change here needs a new HASH_SCHEME."""
    assert hashing.HASH_SCHEME == "blake2b-128/int32le"
    root = hashing.chain_root("fp-golden", "default", 4)
    assert root.hex() == "ed6de12b3ff19818e0f6c2acfeb165b5"
    assert [h.hex() for h in hashing.chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, root)] == [
        "1591c88f48f6fe82c37d67f8f4146892",
        "b66240af7516f1bea0ba9ada2e9a15e6",
    ]


_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
from kvsnap import hashing
root = hashing.chain_root(sys.argv[2], sys.argv[3], 4)
print(json.dumps([root.hex()] + [h.hex() for h in hashing.chain_hashes(json.loads(sys.argv[4]), 4, root)]))
"""


@pytest.mark.parametrize("hash_seed", ["1", "12345"])
def test_hashes_are_identical_across_processes(hash_seed):
    """Guards against Python's salted ``hash()`` sneaking in: another process must agree bit for bit."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(hashing.__file__)))
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, repo, FINGERPRINT, NAMESPACE, json.dumps(TOKENS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    root = _root()
    here = [root.hex()] + [h.hex() for h in hashing.chain_hashes(TOKENS, 4, root)]
    assert json.loads(result.stdout) == here
    assert len(here) == 8
