"""KV port: pins, blocks received from a peer, partial transfers (plain data, no I/O).

A holder and a reader sim side by side; a "transfer" copies block bytes between their pools
the way a NIXL READ would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from services.worker.sim.block_manager import BlockManager
from services.worker.sim.kv_content import block_seeds
from services.worker.sim.kv_pool import KvPool
from services.worker.sim.kv_port import SimKvPort
from services.worker.sim.profile import TimingProfile
from services.worker.sim.scheduler import Scheduler
from services.worker.sim.tokens import generate_tokens
from shared.block_hash import ROOT_PARENT, block_hash_chain
from shared.schemas.generate import SamplingParams
from shared.schemas.kv_events import DEVICE_TIER, HOST_TIER, BlocksMoved, BlockStored

BS = 4
VOCAB = 500
PROFILE = TimingProfile(prefill_ms_per_token=0.05, step_overhead_ms=1.0, decode_base_ms=8.0, decode_ms_per_seq=0.1)
SAMPLING = SamplingParams(max_tokens=5)
PROMPT = [3 + (i * 13) % 400 for i in range(5 * BS + 3)]  # five full blocks and a 3-token tail
HASHES = block_hash_chain(PROMPT, BS)


@dataclass
class Side:
    scheduler: Scheduler
    port: SimKvPort
    pool: KvPool  # the port's, named for short
    blocks: BlockManager

    def run(self, request_id: str, token_ids: list[int], sampling: SamplingParams = SAMPLING,
            unpin_after_admission: Sequence[int] = ()) -> tuple[list[int], int, int]:
        """Run one request to its end, unpinning blocks once it is admitted (the rule for
        received blocks); (its tokens, its cached tokens, prefill tokens of its first step)."""
        self.scheduler.add_request(request_id, token_ids, sampling)
        tokens: list[int] = []
        first_step = 0
        for step in range(1000):
            result = self.scheduler.step(float(step))
            if step == 0:
                self.port.unpin(list(unpin_after_admission))
                first_step = result.prefill_tokens
            output = result.outputs.get(request_id)
            if output is not None:
                tokens += output.token_ids
                if output.finished:
                    return tokens, output.cached_tokens, first_step
        raise AssertionError("the request did not finish")


def make_side(num_blocks: int = 16, host_blocks: int = 0) -> Side:
    blocks = BlockManager(num_blocks, BS, host_blocks=host_blocks)
    pool = KvPool(num_blocks, num_layers=3, block_size=BS, kv_dim=4)
    scheduler = Scheduler(blocks=blocks, pool=pool, profile=PROFILE, vocab_size=VOCAB, max_num_seqs=4,
                          max_num_batched_tokens=64, max_model_len=128)
    return Side(scheduler, SimKvPort(blocks, pool), pool, blocks)


def copy_blocks(source: Side, source_ids: list[int], target: Side, target_ids: list[int]) -> None:
    for source_id, target_id in zip(source_ids, target_ids):
        target.pool.block_view(target_id)[:] = source.pool.block_view(source_id)


def receive_copies(source: Side, source_ids: list[int], reader: Side) -> list[int]:
    """A transfer's landing: blocks allocated on the reader for `source_ids`, their bytes
    copied in the way a NIXL READ would; the reader's new block ids, pinned."""
    target = reader.port.allocate_for_transfer(len(source_ids))
    assert target is not None
    copy_blocks(source, source_ids, reader, target)
    return target


def holder_with_prompt() -> tuple[Side, list[int]]:
    holder = make_side()
    tokens, _, _ = holder.run("h", PROMPT)
    assert tokens == generate_tokens(PROMPT, SAMPLING, VOCAB)[0]
    holder.blocks.take_events()
    return holder, tokens


def test_pin_prefix_pins_the_leading_run_with_checksums_and_blocks_eviction() -> None:
    holder, _ = holder_with_prompt()
    other = block_hash_chain(PROMPT[:2 * BS] + [9] * BS, BS)
    assert holder.port.pin_prefix(other) == holder.blocks.match_prefix(HASHES)[:2]
    holder.port.unpin(holder.blocks.match_prefix(HASHES)[:2])

    ids = holder.port.pin_prefix(HASHES + [12345])
    assert ids == holder.blocks.match_prefix(HASHES) and len(ids) == 5
    checksums = holder.port.block_checksums(ids)
    assert len(checksums) == 5 * holder.pool.num_kv_heads and checksums == holder.pool.block_checksums(ids)
    assert [holder.blocks.ref_count(block_id) for block_id in ids] == [1] * 5
    # Every other block may go, the pinned ones may not.
    assert holder.blocks.allocate(holder.blocks.num_blocks - 4) is None
    taken = holder.blocks.allocate(holder.blocks.num_blocks - 5)
    assert taken is not None and not set(taken) & set(ids)
    assert holder.blocks.match_prefix(HASHES) == ids
    assert all(holder.pool.verify_block(block_id, *holder.blocks.content(block_id)) for block_id in ids)
    holder.blocks.free(taken)
    holder.port.unpin(ids)
    assert holder.blocks.used_blocks == 0 and holder.blocks.evictable_blocks == 5


def test_a_holder_lends_its_host_tier_loading_the_blocks_back_first() -> None:
    holder = make_side(num_blocks=8, host_blocks=16)
    expected, _, _ = holder.run("h", PROMPT)
    holder.run("other", [7 + (i * 11) % 400 for i in range(6 * BS + 1)])  # pushes the prompt's blocks out
    assert holder.blocks.match_prefix(HASHES) == [] and all(holder.blocks.in_host(h) for h in HASHES)
    holder.blocks.take_events()

    ids = holder.port.pin_prefix(HASHES + [12345])
    assert len(ids) == 5 and holder.blocks.match_prefix(HASHES) == ids
    assert all(holder.pool.verify_block(holder.blocks.match_prefix(HASHES)[index], seed, PROMPT[index * BS:(index + 1) * BS])
               for index, seed in enumerate(block_seeds(ROOT_PARENT, PROMPT, BS, 5)))
    assert [holder.blocks.ref_count(block_id) for block_id in ids] == [1] * 5
    moved = [event for event in holder.blocks.take_events() if isinstance(event, BlocksMoved)]
    assert [(event.tier, event.block_hashes) for event in moved if event.tier == DEVICE_TIER] == [(DEVICE_TIER, HASHES)]
    assert all(event.tier == HOST_TIER for event in moved if event.block_hashes != HASHES)

    reader = make_side()
    target = receive_copies(holder, ids, reader)
    holder.port.unpin(ids)
    assert reader.port.commit_transferred(target, 0, PROMPT, [True] * 5) == [True] * 5
    tokens, cached, first_step = reader.run("r", PROMPT, unpin_after_admission=target)
    assert tokens == expected and cached == 5 * BS and first_step == 3
    assert holder.blocks.used_blocks == 0 and reader.blocks.used_blocks == 0


def test_a_host_tier_run_is_lent_as_far_as_the_device_tier_has_room() -> None:
    holder = make_side(num_blocks=8, host_blocks=16)
    holder.run("h", PROMPT)
    holder.run("other", [7 + (i * 11) % 400 for i in range(6 * BS + 1)])
    busy = holder.blocks.allocate(5)  # a running request holds 5 of the 8 blocks
    assert busy is not None and holder.blocks.free_blocks == 3
    ids = holder.port.pin_prefix(HASHES)
    assert len(ids) == 3 and holder.blocks.match_prefix(HASHES) == ids
    assert all(holder.blocks.in_host(h) for h in HASHES[3:])
    holder.port.unpin(ids)
    holder.blocks.free(busy)


def test_a_full_transfer_is_reused_and_gives_the_holders_tokens() -> None:
    holder, expected = holder_with_prompt()
    handle = holder.port.pin_prefix(HASHES)
    reader = make_side()
    target = reader.port.allocate_for_transfer(len(handle))
    assert target is not None and [reader.blocks.ref_count(block_id) for block_id in target] == [1] * 5
    assert reader.blocks.cached_blocks == 0
    copy_blocks(holder, handle, reader, target)
    ours, theirs = reader.port.block_checksums(target), holder.port.block_checksums(handle)
    ok = [mine == held for mine, held in zip(ours, theirs)]  # one KV head: one checksum a block
    holder.port.unpin(handle)
    assert reader.port.commit_transferred(target, 0, PROMPT, ok) == [True] * 5
    assert reader.blocks.take_events() == [BlockStored(block_hashes=HASHES, parent_block_hash=None,
                                                       token_ids=PROMPT[:5 * BS], block_size=BS, chain_hashes=HASHES)]
    tokens, cached, first_step = reader.run("r", PROMPT, unpin_after_admission=target)
    assert tokens == expected and cached == 5 * BS and first_step == 3  # only the tail is computed
    assert reader.run("again", PROMPT)[:2] == (expected, 5 * BS)  # unpinned, the blocks stay cached
    assert reader.scheduler.load().computed_prompt_tokens_total == 2 * 3
    assert holder.blocks.used_blocks == 0 and reader.blocks.used_blocks == 0


def test_a_partial_transfer_recomputes_only_the_failed_blocks() -> None:
    holder, expected = holder_with_prompt()
    source_ids = holder.port.pin_prefix(HASHES)
    reader = make_side()
    target = receive_copies(holder, source_ids, reader)
    holder.port.unpin(source_ids)
    ok = [True, False, True, True, True]  # block 1 never arrived
    reader.pool.block_view(target[3])[100] ^= 1  # block 3 arrived garbled, yet its sender said ok
    committed = reader.port.commit_transferred(target, 0, PROMPT, ok)
    assert committed == [True, False, True, False, True]
    reader.port.unpin([block_id for block_id, good in zip(target, committed) if not good])
    assert reader.blocks.used_blocks == 3 and reader.blocks.cached_blocks == 3
    # Only block 0 joins the router's view now; 2 and 4 wait for their parents.
    assert [event.block_hashes for event in reader.blocks.take_events()] == [HASHES[:1]]

    tokens, cached, first_step = reader.run(
        "r", PROMPT, unpin_after_admission=[block_id for block_id, good in zip(target, committed) if good])
    assert first_step == 2 * BS + 3  # blocks 1 and 3, and the tail
    assert tokens == expected and cached == 3 * BS
    load = reader.scheduler.load()
    assert (load.computed_prompt_tokens_total, load.cached_tokens_total, load.kv_used_blocks) == (11, 12, 0)
    announced = [h for event in reader.blocks.take_events() for h in event.block_hashes]
    assert announced[:4] == HASHES[1:5]  # the holes filled, every block of the prompt is announced in order


def test_refused_blocks_from_the_wrong_place_and_duplicates() -> None:
    holder, _ = holder_with_prompt()
    handle = holder.port.pin_prefix(HASHES)
    reader = make_side()
    reader.run("local", PROMPT[:2 * BS + 1], SamplingParams(max_tokens=1))  # blocks 0 and 1 are cached here
    reader.blocks.take_events()
    target = receive_copies(holder, handle[:4] + [handle[3]], reader)  # block 3's bytes where block 4's belong
    committed = reader.port.commit_transferred(target, 0, PROMPT, [True] * 5)
    assert committed == [True, True, True, True, False]
    assert reader.blocks.lookup(HASHES)[:2] != target[:2]  # the duplicates stayed private
    assert [event.block_hashes for event in reader.blocks.take_events()] == [HASHES[2:4]]
    reader.port.unpin(target)
    holder.port.unpin(handle)
    assert reader.blocks.used_blocks == 0 and reader.blocks.cached_blocks == 4
    assert reader.blocks.evictable_blocks == 4  # the duplicates went back to the free list


def test_received_blocks_after_a_parent_hash() -> None:
    holder, _ = holder_with_prompt()
    handle = holder.port.pin_prefix(HASHES)
    reader = make_side()
    target = receive_copies(holder, handle[2:], reader)
    assert reader.port.commit_transferred(target, 2, PROMPT, [True] * 3) == [True] * 3
    assert reader.blocks.lookup(HASHES) == [None, None] + target
    holder.port.unpin(handle)
    tokens, cached, first_step = reader.run("r", PROMPT, unpin_after_admission=target)
    assert cached == 3 * BS and first_step == 2 * BS + 3
    assert tokens == generate_tokens(PROMPT, SAMPLING, VOCAB)[0] and reader.blocks.used_blocks == 0


def test_allocate_for_transfer_evicts_cached_blocks_and_says_none_when_short() -> None:
    reader = make_side(num_blocks=8)
    reader.run("local", PROMPT)  # five blocks cached, three free
    held = reader.port.allocate_for_transfer(6)
    assert held is not None and reader.blocks.cached_blocks == 2 and reader.blocks.used_blocks == 6
    assert reader.port.allocate_for_transfer(3) is None and reader.blocks.used_blocks == 6
    reader.port.unpin(held)
    assert reader.blocks.used_blocks == 0


@pytest.mark.parametrize("layer", [0, 2])
def test_verify_and_checksum_see_one_bad_byte_in_any_layer(layer: int) -> None:
    holder, _ = holder_with_prompt()
    block_id = holder.blocks.match_prefix(HASHES)[1]
    before = holder.port.block_checksums([block_id])
    seed, tokens = holder.blocks.content(block_id)
    assert holder.pool.verify_block(block_id, seed, tokens) and not holder.pool.verify_block(block_id, seed + 1, tokens)
    holder.pool.block_view(block_id)[layer * holder.pool.layer_nbytes + 5] ^= 0x10
    assert not holder.pool.verify_block(block_id, seed, tokens) and holder.port.block_checksums([block_id]) != before
