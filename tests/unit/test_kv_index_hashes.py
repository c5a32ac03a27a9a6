"""KV index fed Tandem's chain hashes as workers send them: indexed as sent, verified against
token ids on request (mismatches counted), and snapshots swapped in at once with the same
result as applying them event by event."""

from __future__ import annotations

import random

from services.router.kv.index import IngestOutcome, block_hashes_for
from services.router.kv.index_diff import snapshot_diff
from services.router.metrics import RouterMetrics
from shared.codec import MalformedCounter
from shared.schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.unit.test_kv_index import BLOCK, FakeEngine, index_with, tokens


def hashing_engine(worker_id: str) -> FakeEngine:
    return FakeEngine(worker_id, chain_hashes=True)


def wrong_at(event: BlockStored, position: int) -> BlockStored:
    """The event with one chain hash off by one: a worker's hashing bug."""
    assert event.chain_hashes is not None
    chain = list(event.chain_hashes)
    chain[position] ^= 1
    return BlockStored(block_hashes=event.block_hashes, parent_block_hash=event.parent_block_hash,
                       token_ids=event.token_ids, block_size=event.block_size, chain_hashes=chain)


# ---- ingest from chain hashes ------------------------------------------------------------------


def test_chain_hashes_are_indexed_without_token_ids() -> None:
    engine = hashing_engine("a")
    prompt = tokens(1, 6 * BLOCK)
    stored = engine.stored(prompt)
    stored.token_ids = []  # a publisher may leave them out when it sends the chain
    index = index_with(engine)
    result = index.ingest(engine.batch(stored))
    assert (result.outcome, result.stored_blocks, result.rejected_blocks) == (IngestOutcome.APPLIED, 6, 0)
    assert index.match(block_hashes_for(prompt, BLOCK)) == {"a": 6}
    assert index.ingest(engine.batch(engine.removed(prompt, 4, 5))).removed_blocks == 2
    assert index.match(block_hashes_for(prompt, BLOCK)) == {"a": 4}


def test_chain_hashes_are_taken_as_sent_unless_verifying() -> None:
    engine = hashing_engine("a")
    prompt = tokens(2, 4 * BLOCK)
    chain = block_hashes_for(prompt, BLOCK)
    index = index_with(engine)
    result = index.ingest(engine.batch(wrong_at(engine.stored(prompt), 2)))
    assert result.mismatched_blocks == 0  # nobody checked
    assert index.match(chain) == {"a": 2}  # the wrong hash is what the index holds
    assert index.stats().workers[0].mismatched_blocks == 0


def test_a_chain_of_the_wrong_length_falls_back_to_the_token_ids() -> None:
    engine = hashing_engine("a")
    prompt = tokens(3, 3 * BLOCK)
    stored = engine.stored(prompt)
    assert stored.chain_hashes is not None
    stored.chain_hashes = stored.chain_hashes[:2]
    index = index_with(engine)
    assert index.ingest(engine.batch(stored)).stored_blocks == 3
    assert index.match(block_hashes_for(prompt, BLOCK)) == {"a": 3}
    stored.token_ids = []
    other = index_with(engine)
    assert other.ingest(engine.batch(stored)).rejected_blocks == 3  # nothing left to index by


def test_blocks_under_an_unknown_parent_are_indexed_and_still_ask_for_a_resync() -> None:
    engine = hashing_engine("a")
    prompt = tokens(4, 6 * BLOCK)
    index = index_with(engine)
    result = index.ingest(engine.batch(engine.stored(prompt, 3, 6)))  # blocks 0-2 never announced
    assert (result.outcome, result.resync_needed) == (IngestOutcome.GAP, True)
    assert (result.stored_blocks, result.orphaned_blocks) == (3, 0)  # their hashes need no parent
    assert index.match(block_hashes_for(prompt, BLOCK)) == {}  # but no prefix leads to them yet
    index.ingest(engine.batch(engine.stored(prompt, 0, 3)))
    assert index.match(block_hashes_for(prompt, BLOCK)) == {"a": 6}


def test_a_re_announced_head_is_skipped_with_chain_hashes_too() -> None:
    engine = hashing_engine("a")
    prompt = tokens(5, 5 * BLOCK)
    index = index_with(engine)
    index.ingest(engine.batch(engine.stored(prompt, 0, 3)))
    result = index.ingest(engine.batch(engine.stored(prompt)))  # blocks 0-2 again, then 3-4
    assert result.stored_blocks == 2
    assert index.stats().blocks_per_worker == {"a": 5}


# ---- verification --------------------------------------------------------------------------------


def test_verification_counts_a_wrong_hash_and_indexes_the_computed_chain() -> None:
    engine = hashing_engine("a")
    prompt = tokens(6, 5 * BLOCK)
    chain = block_hashes_for(prompt, BLOCK)
    index = index_with(engine, verify_hashes=True)
    good = index.ingest(engine.batch(engine.stored(prompt, 0, 2)))
    assert (good.stored_blocks, good.mismatched_blocks) == (2, 0)
    bad = index.ingest(engine.batch(wrong_at(engine.stored(prompt, 2, 5), 1)))
    assert (bad.outcome, bad.stored_blocks, bad.mismatched_blocks) == (IngestOutcome.APPLIED, 3, 1)
    assert index.match(chain) == {"a": 5}  # the router's own chain, not the wrong one
    stats = index.stats()
    assert (stats.workers[0].mismatched_blocks, stats.mismatched_blocks) == (1, 1)


def test_verification_counts_hashes_sent_without_tokens_as_unverified() -> None:
    engine = hashing_engine("a")
    prompt = tokens(7, 3 * BLOCK)
    stored = engine.stored(prompt)
    stored.token_ids = []
    index = index_with(engine, verify_hashes=True)
    assert index.ingest(engine.batch(stored)).stored_blocks == 3
    worker = index.stats().workers[0]
    assert (worker.unverified_blocks, worker.mismatched_blocks) == (3, 0)


def test_verification_checks_snapshots_too() -> None:
    engine = hashing_engine("a")
    prompt = tokens(8, 4 * BLOCK)
    index = index_with(engine, verify_hashes=True)
    result = index.ingest(engine.batch(AllBlocksCleared(), wrong_at(engine.stored(prompt), 0)))
    # The first block's wrong hash is counted; the rest chain from the router's own.
    assert (result.synced, result.stored_blocks, result.mismatched_blocks) == (True, 4, 1)
    assert index.match(block_hashes_for(prompt, BLOCK)) == {"a": 4}


def test_the_router_metrics_expose_the_mismatch_count() -> None:
    engine = hashing_engine("a")
    index = index_with(engine, verify_hashes=True)
    index.ingest(engine.batch(wrong_at(engine.stored(tokens(9, 3 * BLOCK)), 2)))
    metrics = RouterMetrics(MalformedCounter())
    metrics.watch_kv_index(index.stats)
    text = metrics.exposition()[0].decode()
    assert 'tandem_router_kv_hash_mismatch_blocks_total{worker="a"} 1.0' in text


# ---- snapshots in bulk -----------------------------------------------------------------------------


def test_a_snapshot_with_chain_hashes_replaces_the_view_and_keeps_predictions() -> None:
    engine = hashing_engine("a")
    other = hashing_engine("b")
    stale, kept, new, predicted = (tokens(seed, 4 * BLOCK) for seed in (10, 11, 12, 13))
    index = index_with(engine, other)
    index.ingest(engine.batch(engine.stored(stale), engine.stored(kept)))
    index.ingest(other.batch(other.stored(stale)))
    index.add_speculative("a", block_hashes_for(predicted, BLOCK), expires_at=5.0)
    index.add_speculative("a", block_hashes_for(new, BLOCK)[:2], expires_at=5.0)
    assert index.ingest(engine.batch(engine.removed(stale, 3), seq=9)).resync_needed

    result = index.ingest(engine.batch(AllBlocksCleared(), engine.stored(kept), engine.stored(new)))
    assert (result.outcome, result.synced, result.stored_blocks) == (IngestOutcome.APPLIED, True, 8)
    assert index.unsynced_workers() == []
    assert index.match(block_hashes_for(stale, BLOCK)) == {"b": 4}  # a's copy gone, b's kept
    assert index.match(block_hashes_for(kept, BLOCK)) == {"a": 4}
    assert index.match(block_hashes_for(new, BLOCK)) == {"a": 4}
    assert index.held_prefix("a", block_hashes_for(new, BLOCK), 4) == 4  # predictions became real
    assert index.match(block_hashes_for(predicted, BLOCK)) == {"a": 4}  # still in flight
    assert index.expire(now=6.0) == 4
    assert index.stats().blocks_per_worker == {"a": 8, "b": 4}
    assert index.stats().total_blocks == 12
    assert index.ingest(engine.batch(engine.removed(new, 2, 3))).removed_blocks == 2
    assert index.match(block_hashes_for(new, BLOCK)) == {"a": 2}


def test_a_snapshot_with_two_engine_hashes_for_one_block_keeps_both() -> None:
    engine = hashing_engine("a")
    prompt = tokens(14, 2 * BLOCK)
    chain = block_hashes_for(prompt, BLOCK)
    index = index_with(engine)
    lora = BlockStored(block_hashes=[901, 902], parent_block_hash=None, token_ids=prompt, block_size=BLOCK,
                       chain_hashes=chain)
    index.ingest(engine.batch(AllBlocksCleared(), engine.stored(prompt), lora))
    assert index.stats().blocks_per_worker == {"a": 2}
    index.ingest(engine.batch(engine.removed(prompt, 0, 1)))
    assert index.match(chain) == {"a": 2}  # the other engine hashes still hold them
    index.ingest(engine.batch(BlockRemoved(block_hashes=[901, 902])))
    assert index.match(chain) == {} and index.stats().total_blocks == 0


def test_random_snapshots_in_bulk_equal_event_by_event_application() -> None:
    rng = random.Random(41)
    prompts = [tokens(300 + index, 10 * BLOCK) for index in range(8)]
    prompts += [prompts[0][:4 * BLOCK] + tokens(400 + index, 6 * BLOCK) for index in range(4)]
    chains = [block_hashes_for(prompt, BLOCK) for prompt in prompts]
    hashed = [FakeEngine(f"w{index}", chain_hashes=True) for index in range(3)]
    plain = [FakeEngine(f"w{index}") for index in range(3)]
    bulk = index_with(*hashed)  # snapshots with chain hashes: swapped in at once
    stepwise = index_with(*plain)  # the same snapshots from token ids: applied event by event
    for round_ in range(60):
        worker = rng.randrange(3)
        held = rng.sample(range(len(prompts)), rng.randint(0, 5))
        cuts = {prompt: rng.randint(1, 10) for prompt in held}
        if rng.random() < 0.3:
            predicted = chains[rng.randrange(len(chains))][:rng.randint(1, 10)]
            for index in (bulk, stepwise):
                index.add_speculative(f"w{worker}", predicted, expires_at=round_ + 3.0)
        for index, engine in ((bulk, hashed[worker]), (stepwise, plain[worker])):
            events = [engine.stored(prompts[prompt], 0, cut) for prompt, cut in cuts.items()]
            index.ingest(engine.batch(AllBlocksCleared(), *events, seq=round_ + 1))
            index.expire(now=float(round_))
        for chain in chains:
            assert bulk.match(chain) == stepwise.match(chain)
            for worker_id, overlap in bulk.match(chain).items():
                assert bulk.held_prefix(worker_id, chain, overlap) == stepwise.held_prefix(worker_id, chain, overlap)
        assert bulk.stats().blocks_per_worker == stepwise.stats().blocks_per_worker
        assert bulk.stats().total_blocks == stepwise.stats().total_blocks
    for worker in range(3):  # after the last snapshot, removals find every engine hash
        for index, engine in ((bulk, hashed[worker]), (stepwise, plain[worker])):
            for prompt in prompts:
                index.ingest(engine.batch(engine.removed(prompt, *range(10))))
    assert bulk.expire(now=1e9) == stepwise.expire(now=1e9)
    assert bulk.stats().total_blocks == stepwise.stats().total_blocks == 0



# ---- the snapshot difference ----------------------------------------------------------------------


def test_snapshot_diff_names_what_to_drop_and_add() -> None:
    known = {1: 10, 2: 20, 3: 30, 2**64 - 1: 2**63}
    assert snapshot_diff(known, [[2, 3], [4, 2**64 - 1]], [[20, 30], [40, 2**63]]) == ([1], [4], [40])
    # An engine hash whose chain hash changed is dropped and added again.
    assert snapshot_diff(known, [[1, 2, 3], [2**64 - 1]], [[10, 21, 30], [2**63]]) == ([2], [2], [21])
    assert snapshot_diff(known, [[5, 2], [1]], [[50, 22], [10]]) == ([2, 3, 2**64 - 1], [5, 2], [50, 22])
    assert snapshot_diff(known, [], []) == (sorted(known), [], [])
    assert snapshot_diff({}, [[5], [6]], [[50], [60]]) == ([], [5, 6], [50, 60])


def test_snapshot_diff_declines_what_only_event_by_event_application_defines() -> None:
    assert snapshot_diff({1: 10}, [[2], [2]], [[20], [21]]) is None  # a repeated engine hash: the first one wins
    assert snapshot_diff({1: 10}, [[-2]], [[20]]) is None  # not a u64
    assert snapshot_diff({1: 10}, [[2]], [[2**64]]) is None
    assert snapshot_diff({1: 10}, [[2, 3]], [[20]]) is None
