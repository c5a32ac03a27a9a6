"""The sim's host tier: evicted blocks move there (bounded, LRU), hits load them back at the
profile's load cost, and the KV events say which tier each block is in."""

from __future__ import annotations

from services.worker.sim.block_manager import BlockManager
from services.worker.sim.kv_pool import KvPool
from services.worker.sim.profile import TimingProfile
from services.worker.sim.scheduler import Scheduler
from shared.block_hash import adapter_root, block_hash_chain
from shared.schemas.generate import SamplingParams
from shared.schemas.kv_events import BlockRemoved, BlocksMoved, BlockStored
from tests.unit.sim_blocks import allocated, cache_and_release

BS = 4
VOCAB = 500
PROFILE = TimingProfile(prefill_ms_per_token=0.05, step_overhead_ms=1.0, decode_base_ms=8.0, decode_ms_per_seq=0.1,
                        host_load_ms_per_token=0.01)


def tokens(length: int, start: int) -> list[int]:
    return [start + i for i in range(length)]


def test_evicted_blocks_move_to_the_host_tier() -> None:
    blocks = BlockManager(2, BS, host_blocks=2)
    first = cache_and_release(blocks, tokens(2 * BS, 10))
    blocks.take_events()
    assert blocks.allocate(2) is not None  # evicts both: they move to the host tier
    assert blocks.take_events() == [BlocksMoved(block_hashes=first[::-1], tier="host")]  # a chain's tail goes first
    assert all(blocks.in_host(block_hash) for block_hash in first) and blocks.cached_blocks == 0


def test_a_full_host_tier_drops_its_least_recently_stored_block_as_removed() -> None:
    blocks = BlockManager(1, BS, host_blocks=1)
    old = cache_and_release(blocks, tokens(BS, 10))
    new = cache_and_release(blocks, tokens(BS, 50))  # evicts `old` to the host tier
    blocks.take_events()
    assert blocks.allocate(1) is not None  # evicts `new` there: `old` leaves every tier
    assert blocks.take_events() == [BlocksMoved(block_hashes=new, tier="host"), BlockRemoved(block_hashes=old)]
    assert not blocks.in_host(old[0]) and blocks.in_host(new[0])


def test_without_a_host_tier_an_evicted_block_is_removed() -> None:
    blocks = BlockManager(1, BS)
    old = cache_and_release(blocks, tokens(BS, 10))
    blocks.take_events()
    assert blocks.allocate(1) is not None
    assert blocks.take_events() == [BlockRemoved(block_hashes=old)]


def test_loading_brings_blocks_back_to_the_device_tier() -> None:
    blocks = BlockManager(2, BS, host_blocks=4)
    hashes = cache_and_release(blocks, tokens(2 * BS, 10))
    ids = allocated(blocks, 2)
    blocks.free(ids)
    blocks.take_events()
    loaded = blocks.load_from_host(hashes)
    assert loaded is not None and blocks.lookup(hashes) == loaded
    assert [blocks.ref_count(block_id) for block_id in loaded] == [1, 1]
    assert not any(blocks.in_host(block_hash) for block_hash in hashes)
    assert blocks.take_events() == [BlocksMoved(block_hashes=hashes, tier="device")]
    assert blocks.loaded_blocks_total == 2
    blocks.pin(loaded)  # the device tier is now full of referenced blocks
    assert blocks.load_from_host([]) == [] and blocks.allocate(1) is None


def test_a_snapshot_lists_host_blocks_in_their_tier_parents_first() -> None:
    blocks = BlockManager(2, BS, host_blocks=4)
    text = tokens(3 * BS, 10)
    hashes = block_hash_chain(text, BS)
    ids = allocated(blocks, 2)
    blocks.commit(ids, hashes[:2], text[:2 * BS], None)
    blocks.free(ids)
    third = allocated(blocks, 1)  # evicts the first block (least recently released: the tail goes first)
    blocks.commit(third, hashes[2:], text[2 * BS:], hashes[1])
    snapshot = blocks.snapshot()
    where = {block_hash: event.tier for event in snapshot for block_hash in event.block_hashes}
    assert sorted(where) == sorted(hashes)
    assert sum(tier == "host" for tier in where.values()) == 1
    seen: set[int] = set()
    for event in snapshot:
        assert event.parent_block_hash is None or event.parent_block_hash in seen
        assert event.chain_hashes == event.block_hashes
        seen.update(event.block_hashes)


def make_scheduler(num_blocks: int, host_blocks: int) -> Scheduler:
    return Scheduler(blocks=BlockManager(num_blocks, BS, host_blocks=host_blocks),
                     pool=KvPool(num_blocks, num_layers=2, block_size=BS, kv_dim=4), profile=PROFILE,
                     vocab_size=VOCAB, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)


def serve(scheduler: Scheduler, request_id: str, prompt: list[int]) -> tuple[list[int], int, float]:
    """Run one request alone: its tokens, cached prompt tokens, and its first step's duration."""
    scheduler.add_request(request_id, prompt, SamplingParams(max_tokens=2))
    generated: list[int] = []
    first_step_s = None
    cached = -1
    while scheduler.has_work:
        result = scheduler.step(0.0)
        first_step_s = result.duration_s if first_step_s is None else first_step_s
        output = result.outputs.get(request_id)
        if output is not None:
            generated += output.token_ids
            cached = output.cached_tokens if output.finished else cached
    assert first_step_s is not None
    return generated, cached, first_step_s


def test_a_host_tier_hit_is_reused_at_its_load_cost_with_the_same_answer() -> None:
    prompt, other = tokens(32, 10), tokens(32, 200)
    scheduler = make_scheduler(num_blocks=10, host_blocks=16)
    reference, _, computed_s = serve(scheduler, "first", prompt)
    serve(scheduler, "other", other)  # pushes the first prompt's blocks to the host tier
    assert all(scheduler.blocks.in_host(block_hash) for block_hash in block_hash_chain(prompt, BS)[1:7])
    again, cached, loaded_s = serve(scheduler, "again", prompt)
    assert again == reference  # the loaded KV is intact
    assert cached == 28 and scheduler.loaded_prompt_tokens_total >= 16
    assert loaded_s < computed_s  # loading 7 blocks costs less than computing them


def test_without_a_host_tier_the_same_prompt_is_computed_again() -> None:
    prompt, other = tokens(32, 10), tokens(32, 200)
    scheduler = make_scheduler(num_blocks=10, host_blocks=0)
    reference, _, _ = serve(scheduler, "first", prompt)
    serve(scheduler, "other", other)
    again, cached, _ = serve(scheduler, "again", prompt)
    assert again == reference and cached < 28 and scheduler.loaded_prompt_tokens_total == 0


def test_step_duration_charges_loaded_tokens_below_their_prefill_cost() -> None:
    loaded = PROFILE.step_duration_s(prefill_tokens=1, decode_seqs=0, loaded_tokens=100)
    computed = PROFILE.step_duration_s(prefill_tokens=101, decode_seqs=0)
    base = PROFILE.step_duration_s(prefill_tokens=1, decode_seqs=0)
    assert base < loaded < computed
    default = TimingProfile(prefill_ms_per_token=0.05, step_overhead_ms=1.0, decode_base_ms=8.0, decode_ms_per_seq=0.1)
    assert 0 < default.host_load_ms < default.prefill_ms_per_token
    assert BlockStored(block_hashes=[], parent_block_hash=None, block_size=BS).tier == "device"


def test_a_block_computed_again_replaces_its_host_copy_removed_then_stored() -> None:
    blocks = BlockManager(1, BS, host_blocks=2)
    text = tokens(BS, 10)
    hashes = cache_and_release(blocks, text)
    assert blocks.allocate(1) is not None  # `hashes` moves to the host tier; the device tier is full
    blocks.take_events()
    blocks.free([0])
    ids = allocated(blocks, 1)
    blocks.commit(ids, hashes, text, None)  # computed again instead of loaded
    events = blocks.take_events()
    assert events[-2:] == [BlockRemoved(block_hashes=hashes),
                           BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=text, block_size=BS,
                                       chain_hashes=hashes)]
    assert not blocks.in_host(hashes[0]) and blocks.lookup(hashes) == ids


def test_an_adapters_block_keeps_its_adapter_in_the_host_tier_and_back() -> None:
    blocks = BlockManager(1, BS, host_blocks=1)
    token_ids = tokens(BS, 10)
    [block_hash] = block_hash_chain(token_ids, BS, parent_hash=adapter_root("alpha"))
    ids = allocated(blocks, 1)
    blocks.commit(ids, [block_hash], token_ids, None, adapter="alpha")
    blocks.free(ids)
    assert blocks.allocate(1) is not None  # evicted to the host tier
    assert [(e.block_hashes, e.tier, e.adapter) for e in blocks.snapshot()] == [([block_hash], "host", "alpha")]
    blocks.free([0])
    assert blocks.load_from_host([block_hash]) is not None
    assert [(e.block_hashes, e.tier, e.adapter) for e in blocks.snapshot()] == [([block_hash], "device", "alpha")]
