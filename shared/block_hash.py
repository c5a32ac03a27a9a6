"""Tandem's block-hash chain, computed from token ids alone.

hash(block i) = H(hash(block i-1) || salt || token ids of block i), 64-bit.
Two workers with the same block size agree on every hash of a shared prefix, whatever
engine they run; routers compute the same chain from tokenized requests. Only full
blocks are hashed: a partial tail block is never shared.
"""

from __future__ import annotations

import hashlib
from array import array

ROOT_PARENT = 0


def hash_block(parent_hash: int, token_ids: list[int] | tuple[int, ...], salt: bytes = b"") -> int:
    digest = hashlib.blake2b(digest_size=8)
    digest.update(parent_hash.to_bytes(8, "little"))
    if salt:
        digest.update(salt)
    digest.update(array("I", token_ids).tobytes())
    return int.from_bytes(digest.digest(), "little")


def block_hash_chain(
    token_ids: list[int], block_size: int, *, parent_hash: int = ROOT_PARENT, salt: bytes = b""
) -> list[int]:
    """Hashes of every full block of `token_ids`, chained from `parent_hash`."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start : start + block_size], salt)
        hashes.append(parent_hash)
    return hashes
