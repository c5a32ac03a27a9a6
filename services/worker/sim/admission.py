"""Admitting a waiting sim request: reuse every cached block of its prompt's chain, load
the host-tier ones back, allocate the rest (pure, synchronous).

Caller: `scheduler.Scheduler`, for the request at the head of its waiting queue. A chain
hash covers the whole prefix, so a cached block is valid KV even when an earlier one is
missing: every hit is reused, not only the leading run, and the holes before the last reused
block get their blocks at once (`request.block_ids` has no gaps). At least one token is
always computed, so that the last token's logits exist. The scheduler keeps the counters:
`Admission` says what this admission loaded.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from services.worker.sim.block_manager import BlockManager
from services.worker.sim.kv_pool import KvPool
from services.worker.sim.request import SimRequest
from services.worker.sim.request_kv import write_loaded


@dataclass(frozen=True, slots=True)
class Admission:
    # (tokens to compute, position after them), or None: blocks are short and the request
    # waits (its references dropped)
    chunk: tuple[int, int] | None
    # prompt tokens loaded back from the host tier, counted even when the request waits:
    # those blocks stay cached in the device tier
    loaded_tokens: int = 0


def admit(blocks: BlockManager, pool: KvPool | None, request: SimRequest, budget: int) -> Admission:
    """Reuse every cached block of the prompt's chain and allocate the blocks the holes
    and the first chunk need, within `budget` tokens. A first admission (not a resumption
    after preemption) sets `request.num_cached_tokens` and counts the misses evicted here."""
    size = blocks.block_size
    # At most num_tokens - 1 tokens come from the cache: the last one must be computed.
    hashes = request.block_hashes[:(request.num_tokens - 1) // size]
    found = blocks.lookup(hashes)
    hosted = [index for index, block_id in enumerate(found) if block_id is None and blocks.in_host(hashes[index])]
    loaded_tokens = 0
    if hosted:
        loaded = load_hosted(blocks, pool, request, found, hosted)
        if loaded is None:
            return Admission(None)
        found, loaded_tokens = loaded, len(hosted) * size
    reused = [index for index, block_id in enumerate(found) if block_id is not None]
    leading = next((index for index, block_id in enumerate(found) if block_id is None), len(found))
    request.num_computed_tokens = leading * size
    request.reused_ahead = deque(reused[leading:])
    num_new = min(request.to_compute(), budget)
    end = request.chunk_end(num_new)
    # Holes before the last reused block get their blocks now: block_ids has no gaps.
    num_blocks = max(-(-end // size), reused[-1] + 1 if reused else 0)
    reused_ids = [block_id for block_id in found if block_id is not None]
    loaded_ids = {found[index] for index in hosted}
    # before allocating, so that allocation cannot evict them (loaded blocks hold their reference)
    blocks.touch([block_id for block_id in reused_ids if block_id not in loaded_ids])
    new_blocks = blocks.allocate(num_blocks - len(reused_ids))
    if new_blocks is None:
        blocks.free(reused_ids)  # loaded blocks stay cached in the device tier
        request.num_computed_tokens = 0
        request.reused_ahead.clear()
        return Admission(None, loaded_tokens)
    fresh = iter(new_blocks)
    request.block_ids = [found[index] if index < len(found) and found[index] is not None else next(fresh)
                         for index in range(num_blocks)]
    request.kv_checked = False
    if request.num_cached_tokens < 0:  # first admission (not a resumption after preemption)
        request.num_cached_tokens = len(reused_ids) * size
        blocks.note_misses([block_hash for block_hash, block_id in zip(request.block_hashes, found)
                            if block_id is None])
    return Admission((num_new, end), loaded_tokens)


def load_hosted(blocks: BlockManager, pool: KvPool | None, request: SimRequest, found: list[int | None],
                hosted: list[int]) -> list[int | None] | None:
    """`found` with the host-tier blocks at indices `hosted` loaded into the device tier
    (their KV bytes written again into `pool`); None (nothing loaded) when the device tier
    cannot take them now."""
    # touched first, so that the loads' evictions cannot take the device hits
    device_ids = [block_id for block_id in found if block_id is not None]
    blocks.touch(device_ids)
    loaded_ids = blocks.load_from_host([request.block_hashes[index] for index in hosted])
    blocks.free(device_ids)
    if loaded_ids is None:
        return None
    if pool is not None:  # the KV bytes come back with the blocks
        write_loaded(pool, request, hosted, loaded_ids)
    found = list(found)
    for index, block_id in zip(hosted, loaded_ids):
        found[index] = block_id
    return found
