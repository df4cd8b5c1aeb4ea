"""Chained block hashes: the identity of a block of tokens at its position.

``block_hash[i] = H(block_hash[i-1] || token ids of block i as little-endian int32)`` and the
chain root is ``H(model fingerprint || namespace salt || block size)``. H is BLAKE2b with a
16-byte digest. The bytes hashed are pinned (fixed-width little-endian), so a hash is the same
in every process and on every machine. ``checksum`` (xxh3-64) guards stored bytes against damage.
No torch here.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

import xxhash

HASH_SCHEME = "blake2b-128/int32le"
DIGEST_SIZE = 16
_ROOT_PERSON = b"kvsnap-root-v1"
_BLOCK_PERSON = b"kvsnap-block-v1"


def _h(data: bytes, person: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE, person=person).digest()


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int32 bytes (the only byte form of tokens that is hashed or stored)."""
    arr = array("i", token_ids)
    assert arr.itemsize == 4
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def tokens_from_bytes(data: bytes) -> list[int]:
    arr = array("i")
    arr.frombytes(data)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tolist()


def chain_root(fingerprint: str, namespace: str, block_size: int) -> bytes:
    """The parent hash of block 0: ties every chain to one model, one namespace and one block size."""
    fp = fingerprint.encode()
    ns = namespace.encode()
    data = struct.pack("<I", len(fp)) + fp + struct.pack("<I", len(ns)) + ns + struct.pack("<I", block_size)
    return _h(data, _ROOT_PERSON)


def block_hash(parent: bytes, block_token_ids: Sequence[int]) -> bytes:
    return _h(parent + token_bytes(block_token_ids), _BLOCK_PERSON)


def chain_hashes(token_ids: Sequence[int], block_size: int, root: bytes) -> list[bytes]:
    """Hashes of every *full* block of ``token_ids``; a trailing partial block has none."""
    hashes: list[bytes] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def checksum(data: bytes | bytearray | memoryview) -> str:
    """Integrity checksum of stored bytes (not a security hash): xxh3-64, hex.

    Catches damage on disk; the chained BLAKE2b hashes above are what identify content.
    """
    return xxhash.xxh3_64_hexdigest(data)
