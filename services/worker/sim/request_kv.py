"""A sim request's KV bytes in the pool: the seeds of its blocks, writing the blocks it
computes, checking the ones it uses (pure: the pool is memory, not I/O).

Callers: `scheduler.Scheduler` (writes what a step computed, checks a prefill's blocks once
before sampling) and `admission.load_hosted` (writes blocks loaded back from the host tier). A request keeps the seed of
each block it has started (`SimRequest.seeds`, `kv_content`): block `i`'s bytes follow from
`seeds[i]` and its tokens.
"""

from __future__ import annotations

from services.worker.sim.kv_content import advance, block_seeds, next_prefix
from services.worker.sim.kv_pool import KvPool
from services.worker.sim.request import SimRequest


def start_seeds(request: SimRequest) -> None:
    """The seeds of the prompt's full blocks and of the block after them, and the prefix
    hash after its last token (where generated tokens go on from)."""
    size = request.block_size
    full = request.num_tokens // size
    request.seeds = block_seeds(request.root_hash, request.token_ids, size, full + 1)
    request.last_prefix = advance(request.seeds[full], request.token_ids[full * size:])


def append_token(request: SimRequest, token_id: int) -> None:
    """Follow a generated token: its prefix hash, and a new block's seed when one fills."""
    request.token_ids.append(token_id)
    request.last_prefix = next_prefix(request.last_prefix, token_id)
    if request.num_tokens % request.block_size == 0:
        request.seeds.append(request.last_prefix)


def write_kv(pool: KvPool, request: SimRequest, computed: list[int], end: int) -> None:
    """Write the KV bytes of the blocks at indices `computed`, filled up to position `end`."""
    size = request.block_size
    for index in computed:
        start = index * size
        pool.write_block(request.block_ids[index], request.seeds[index], request.token_ids[start:min(start + size, end)])


def write_loaded(pool: KvPool, request: SimRequest, indices: list[int], block_ids: list[int]) -> None:
    """Write the request's full blocks at `indices` into `block_ids`, loaded back from the
    host tier."""
    size = request.block_size
    for index, block_id in zip(indices, block_ids):
        pool.write_block(block_id, request.seeds[index], request.token_ids[index * size:(index + 1) * size])


def kv_intact(pool: KvPool, request: SimRequest) -> bool:
    """Whether the KV bytes of every full block the request uses are its tokens' KV."""
    size = request.block_size
    full = request.num_computed_tokens // size
    return all(pool.verify_block(block_id, request.seeds[index], request.token_ids[index * size:(index + 1) * size])
               for index, block_id in enumerate(request.block_ids[:full]))
