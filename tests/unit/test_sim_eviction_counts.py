"""The sim's eviction counters: cached blocks evicted to make room, and the evicted blocks a
later request missed (reported in the engine load, for the routing sweep)."""

from __future__ import annotations

from services.worker.sim.block_manager import BlockManager
from services.worker.sim.kv_pool import KvPool
from services.worker.sim.profile import TimingProfile
from services.worker.sim.scheduler import Scheduler
from shared.schemas.generate import SamplingParams
from tests.unit.sim_blocks import cache_and_release

BS = 4
PROFILE = TimingProfile(prefill_ms_per_token=0.05, step_overhead_ms=1.0, decode_base_ms=8.0, decode_ms_per_seq=0.1)


def test_evictions_are_counted_and_a_later_miss_of_an_evicted_block_once() -> None:
    blocks = BlockManager(4, BS)
    first = cache_and_release(blocks, list(range(3, 3 + 2 * BS)))
    held = blocks.allocate(2)  # the two free blocks: nothing evicted
    assert held is not None and blocks.evicted_blocks_total == 0
    second = blocks.allocate(1)  # evicts the least recently used cached block (the tail first)
    assert second is not None and blocks.evicted_blocks_total == 1
    blocks.note_misses(first)  # only the evicted one of the two counts
    assert blocks.evicted_missed_blocks_total == 1
    blocks.note_misses(first)  # counted once per eviction
    assert blocks.evicted_missed_blocks_total == 1
    blocks.free(held + second)
    again = cache_and_release(blocks, list(range(100, 100 + 4 * BS)))  # evicts the other one too
    assert blocks.evicted_blocks_total == 2 and len(again) == 4


def test_a_block_cached_again_after_its_eviction_is_no_longer_a_miss() -> None:
    blocks = BlockManager(2, BS)
    tokens = list(range(3, 3 + 2 * BS))
    hashes = cache_and_release(blocks, tokens)
    cache_and_release(blocks, list(range(200, 200 + 2 * BS)))  # evicts both
    assert blocks.evicted_blocks_total == 2
    cache_and_release(blocks, tokens)  # recomputed and cached again (evicting the others)
    blocks.note_misses(hashes)
    assert blocks.evicted_missed_blocks_total == 0 and blocks.evicted_blocks_total == 4


def test_the_scheduler_reports_evictions_and_re_misses_in_its_load() -> None:
    scheduler = Scheduler(blocks=BlockManager(12, BS), pool=KvPool(12, num_layers=1, block_size=BS, kv_dim=4),
                          profile=PROFILE, vocab_size=500, max_num_seqs=4, max_num_batched_tokens=64,
                          max_model_len=64)
    sampling = SamplingParams(max_tokens=1)
    for request_id, start in (("a", 3), ("b", 100), ("a-again", 3)):
        scheduler.add_request(request_id, list(range(start, start + 8 * BS)), sampling)
        while scheduler.has_work:
            scheduler.step(0.0)
    load = scheduler.load()
    assert load.kv_evicted_blocks_total > 0
    # "a-again" needed the blocks "b" pushed out: each one it missed had been evicted here
    assert 0 < load.kv_evicted_missed_blocks_total <= load.kv_evicted_blocks_total
