"""Block manager: ref counts, prefix cache, LRU eviction, KV events, snapshots."""

from __future__ import annotations

from services.worker.sim.block_manager import BlockManager
from shared.block_hash import block_hash_chain
from shared.schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.unit.sim_blocks import allocated, cache_sequence

BS = 4


def test_allocate_free_and_ref_counts() -> None:
    blocks = BlockManager(8, BS)
    first = blocks.allocate(3)
    assert first is not None and len(set(first)) == 3
    assert (blocks.used_blocks, blocks.free_blocks) == (3, 5)
    blocks.free(first[:1])
    assert (blocks.used_blocks, blocks.free_blocks) == (2, 6)
    assert blocks.ref_count(first[0]) == 0 and blocks.ref_count(first[1]) == 1
    blocks.free(first[1:])
    assert (blocks.used_blocks, blocks.free_blocks, blocks.cached_blocks) == (0, 8, 0)
    assert blocks.take_events() == []  # uncached blocks come and go silently


def test_out_of_blocks_is_none_and_changes_nothing() -> None:
    blocks = BlockManager(4, BS)
    ids, hashes = cache_sequence(blocks, list(range(3, 3 + 2 * BS)))
    blocks.free(ids)  # two evictable, two free
    blocks.take_events()
    allocated(blocks, 3)  # two free ones, then evicts the least recently used cached one
    assert blocks.allocate(2) is None
    assert (blocks.used_blocks, blocks.free_blocks, blocks.cached_blocks) == (3, 1, 1)
    # Freed tail first, so the sequence's second block was the least recently used.
    assert blocks.take_events() == [BlockRemoved(block_hashes=[hashes[1]])]
    assert blocks.match_prefix(hashes) == ids[:1]


def test_commit_announces_one_event_with_the_tandem_hash_chain() -> None:
    blocks = BlockManager(8, BS)
    tokens = list(range(10, 10 + 3 * BS))
    ids, hashes = cache_sequence(blocks, tokens)
    assert hashes == block_hash_chain(tokens, BS)
    assert blocks.take_events() == [BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens,
                                                block_size=BS, chain_hashes=hashes)]
    assert [blocks.block_hash(block_id) for block_id in ids] == hashes
    assert blocks.cached_blocks == 3 and blocks.used_blocks == 3


def test_match_prefix_is_the_longest_cached_prefix() -> None:
    blocks = BlockManager(8, BS)
    tokens = list(range(3, 3 + 3 * BS))
    ids, hashes = cache_sequence(blocks, tokens)
    other = block_hash_chain(tokens[:2 * BS] + [99] * BS, BS)
    assert blocks.match_prefix(hashes) == ids
    assert blocks.match_prefix(other) == ids[:2]
    assert blocks.match_prefix(block_hash_chain([99] + tokens[1:], BS)) == []  # the chain covers the prefix
    blocks.touch(ids[:2])
    assert [blocks.ref_count(block_id) for block_id in ids] == [2, 2, 1]


def test_duplicate_commit_stays_private_and_is_not_announced() -> None:
    blocks = BlockManager(8, BS)
    tokens = list(range(3, 3 + 2 * BS))
    first_ids, hashes = cache_sequence(blocks, tokens)
    blocks.take_events()
    second_ids, _ = cache_sequence(blocks, tokens)
    assert blocks.take_events() == []
    assert blocks.cached_blocks == 2 and blocks.used_blocks == 4
    blocks.free(second_ids)
    assert blocks.free_blocks == 6 and blocks.evictable_blocks == 0  # private duplicates go to the free list
    assert blocks.match_prefix(hashes) == first_ids


def test_lru_eviction_only_when_free_blocks_run_out() -> None:
    blocks = BlockManager(6, BS)
    a_ids, a_hashes = cache_sequence(blocks, [5] * (2 * BS))
    b_ids, b_hashes = cache_sequence(blocks, [7] * (2 * BS))
    blocks.free(a_ids)
    blocks.free(b_ids)
    blocks.touch(blocks.match_prefix(a_hashes))  # A is used again: B becomes least recent
    blocks.free(a_ids)
    blocks.take_events()

    two = blocks.allocate(2)  # the two never-used blocks: no eviction yet
    assert two is not None and blocks.cached_blocks == 4 and blocks.take_events() == []

    allocated(blocks, 3)
    # B's blocks go first, tail before head; then A's tail.
    assert blocks.take_events() == [BlockRemoved(block_hashes=[b_hashes[1], b_hashes[0], a_hashes[1]])]
    assert blocks.match_prefix(b_hashes) == []
    assert blocks.match_prefix(a_hashes) == a_ids[:1]
    assert blocks.free_blocks == 1 and blocks.used_blocks == 5


def test_snapshot_lists_every_cached_block_parents_first() -> None:
    blocks = BlockManager(16, BS)
    trunk = list(range(3, 3 + 2 * BS))
    ids, hashes = cache_sequence(blocks, trunk + [50] * BS)
    # A second sequence shares the trunk and branches off with its own third block.
    blocks.touch(ids[:2])
    branch_tokens = [60] * BS
    branch_hash = block_hash_chain(trunk + branch_tokens, BS)[2]
    branch_ids = allocated(blocks, 1)
    blocks.commit(branch_ids, [branch_hash], branch_tokens, hashes[1])
    announced = blocks.take_events()
    assert announced[1] == BlockStored(block_hashes=[branch_hash], parent_block_hash=hashes[1],
                                       token_ids=branch_tokens, block_size=BS, chain_hashes=[branch_hash])

    snapshot = blocks.snapshot()
    seen: set[int | None] = {None}
    tokens_by_hash: dict[int, list[int]] = {}
    for event in snapshot:
        assert event.parent_block_hash in seen
        for index, block_hash in enumerate(event.block_hashes):
            tokens_by_hash[block_hash] = event.token_ids[index * BS:(index + 1) * BS]
            seen.add(block_hash)
    assert set(tokens_by_hash) == set(hashes) | {branch_hash}
    assert tokens_by_hash[branch_hash] == branch_tokens
    assert len(snapshot) == 2  # the trunk with one child, and the other child


def test_reset_prefix_cache_is_refused_while_blocks_are_used() -> None:
    blocks = BlockManager(4, BS)
    ids, hashes = cache_sequence(blocks, list(range(3, 3 + 2 * BS)))
    blocks.take_events()
    assert blocks.reset_prefix_cache() is False
    blocks.free(ids)
    assert blocks.reset_prefix_cache() is True
    assert blocks.take_events() == [AllBlocksCleared()]
    assert (blocks.cached_blocks, blocks.free_blocks, blocks.match_prefix(hashes)) == (0, 4, [])
    assert blocks.snapshot() == []


def test_lookup_finds_cached_blocks_behind_holes() -> None:
    blocks = BlockManager(8, BS)
    tokens = list(range(3, 3 + 3 * BS))
    ids, hashes = cache_sequence(blocks, tokens)
    blocks.free(ids[1:2])
    blocks.free(ids[:1] + ids[2:])
    assert blocks.allocate(6) is not None  # the free ones, then the least recently used: block 1
    assert blocks.lookup(hashes) == [ids[0], None, ids[2]]
    assert blocks.match_prefix(hashes) == ids[:1]


def test_a_block_behind_a_hole_is_cached_at_once_and_announced_with_its_parent() -> None:
    blocks = BlockManager(8, BS)
    tokens = list(range(3, 3 + 4 * BS))
    hashes = block_hash_chain(tokens, BS)
    ids = allocated(blocks, 4)
    blocks.commit(ids[2:], hashes[2:], tokens[2 * BS:], hashes[1])  # blocks 2-3 arrive first
    assert blocks.take_events() == [] and blocks.lookup(hashes) == [None, None, ids[2], ids[3]]
    assert blocks.snapshot() == []  # a snapshot shows only what was announced
    blocks.commit(ids[:2], hashes[:2], tokens[:2 * BS], None)
    assert blocks.take_events() == [
        BlockStored(block_hashes=hashes[:2], parent_block_hash=None, token_ids=tokens[:2 * BS], block_size=BS,
                    chain_hashes=hashes[:2]),
        BlockStored(block_hashes=hashes[2:], parent_block_hash=hashes[1], token_ids=tokens[2 * BS:], block_size=BS,
                    chain_hashes=hashes[2:])]
    assert [h for event in blocks.snapshot() for h in event.block_hashes] == hashes


def test_evicting_an_unannounced_block_is_silent() -> None:
    blocks = BlockManager(2, BS)
    tokens = list(range(3, 3 + 2 * BS))
    hashes = block_hash_chain(tokens, BS)
    ids = allocated(blocks, 1)
    blocks.commit(ids, hashes[1:], tokens[BS:], hashes[0])
    blocks.free(ids)
    assert blocks.allocate(2) is not None and blocks.cached_blocks == 0
    assert blocks.take_events() == []


def test_pin_keeps_free_and_evictable_blocks_out_of_allocation() -> None:
    blocks = BlockManager(4, BS)
    ids, hashes = cache_sequence(blocks, list(range(3, 3 + 2 * BS)))
    private = allocated(blocks, 1)
    blocks.free(ids + private)  # two evictable, two free
    blocks.pin([ids[1], private[0]])
    assert (blocks.used_blocks, blocks.free_blocks) == (2, 2)
    assert blocks.allocate(3) is None
    held = blocks.allocate(2)
    assert held is not None and private[0] not in held and ids[1] not in held
    assert blocks.lookup(hashes) == [None, ids[1]]  # the unpinned cached block was evicted
    blocks.free(held + [ids[1], private[0]])
    assert (blocks.used_blocks, blocks.free_blocks) == (0, 4)
