"""Filling a sim `BlockManager` in its unit tests: blocks allocated (asserting there was
room), and the full blocks of a token sequence computed and cached as a request would."""

from __future__ import annotations

from services.worker.sim.block_manager import BlockManager
from shared.block_hash import block_hash_chain


def allocated(blocks: BlockManager, count: int) -> list[int]:
    ids = blocks.allocate(count)
    assert ids is not None, f"no room for {count} blocks"
    return ids


def cache_sequence(blocks: BlockManager, token_ids: list[int]) -> tuple[list[int], list[int]]:
    """Allocate, commit and keep referenced the full blocks of `token_ids`: their ids and hashes."""
    size = blocks.block_size
    hashes = block_hash_chain(token_ids, size)
    ids = allocated(blocks, len(hashes))
    blocks.commit(ids, hashes, token_ids[:len(hashes) * size], None)
    return ids, hashes


def cache_and_release(blocks: BlockManager, token_ids: list[int]) -> list[int]:
    """Compute and cache the full blocks of `token_ids`, then drop the request's references."""
    ids, hashes = cache_sequence(blocks, token_ids)
    blocks.free(ids)
    return hashes
