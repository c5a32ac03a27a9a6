"""KV index on plain data: hash chain, overlap, sequence gaps and snapshots, removal, purge,
speculation, block sizes and salts, and a randomized check against a naive model."""

from __future__ import annotations

import random

import pytest

from services.router.kv.index import IngestOutcome, KvIndex, block_hashes_for
from shared.block_hash import block_hash_chain
from shared.schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch

BLOCK = 4


def engine_hashes(tandem_hashes: list[int]) -> list[int]:
    """An engine's own hashes: content-defined, but not Tandem's."""
    return [(block_hash * 0x9E3779B97F4A7C15 + 7) % 2**64 for block_hash in tandem_hashes]


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(count)]


class FakeEngine:
    """Announces what a worker caches the way engines do: engine hashes, parent links, token ids,
    and, if `chain_hashes`, Tandem's chain hashes as workers compute them."""

    def __init__(self, worker_id: str, block_size: int = BLOCK, salt: bytes = b"", *,
                 chain_hashes: bool = False) -> None:
        self.worker_id = worker_id
        self.block_size = block_size
        self.salt = salt
        self.chain_hashes = chain_hashes
        self.seq = 0

    def chain(self, token_ids: list[int]) -> list[int]:
        return block_hash_chain(token_ids, self.block_size, salt=self.salt)

    def stored(self, token_ids: list[int], start_block: int = 0, stop_block: int | None = None) -> BlockStored:
        """Blocks [start_block, stop_block) of a sequence, as one `BlockStored`."""
        chain = self.chain(token_ids)
        stop_block = len(chain) if stop_block is None else stop_block
        parent = engine_hashes([chain[start_block - 1]])[0] if start_block else None
        return BlockStored(block_hashes=engine_hashes(chain[start_block:stop_block]), parent_block_hash=parent,
                           token_ids=token_ids[start_block * self.block_size:stop_block * self.block_size],
                           block_size=self.block_size,
                           chain_hashes=chain[start_block:stop_block] if self.chain_hashes else None)

    def removed(self, token_ids: list[int], *block_indexes: int) -> BlockRemoved:
        chain = self.chain(token_ids)
        return BlockRemoved(block_hashes=engine_hashes([chain[index] for index in block_indexes]))

    def batch(self, *events: KvEvent, seq: int | None = None) -> KvEventBatch:
        self.seq = self.seq + 1 if seq is None else seq
        return KvEventBatch(worker_id=self.worker_id, seq=self.seq, ts=0.0, events=list(events))


def index_with(*engines: FakeEngine, verify_hashes: bool = False) -> KvIndex:
    """An index that knows `engines` as its workers (their block sizes and salts)."""
    index = KvIndex(verify_hashes=verify_hashes)
    for engine in engines:
        index.add_worker(engine.worker_id, engine.block_size, engine.salt)
    return index


# ---- hashing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
@pytest.mark.parametrize("salt", [b"", b"model-v2"])
def test_block_hashes_for_equals_the_shared_chain(block_size: int, salt: bytes) -> None:
    token_ids = tokens(1, 16 * 5 + 3)  # a partial tail block is not hashed
    assert block_hashes_for(token_ids, block_size, salt) == block_hash_chain(token_ids, block_size, salt=salt)
    assert block_hashes_for(tuple(token_ids), block_size, salt, parent_hash=12345) == \
        block_hash_chain(token_ids, block_size, parent_hash=12345, salt=salt)
    assert block_hashes_for(token_ids[:block_size - 1], block_size, salt) == []


def test_index_keys_are_tandem_hashes_from_token_ids_not_engine_hashes() -> None:
    engine = FakeEngine("a")
    prompt = tokens(2, 10 * BLOCK)
    index = index_with(engine)
    # Announced in two chunks, the second linked to the first by the engine's parent hash.
    assert index.ingest(engine.batch(engine.stored(prompt, 0, 6))).stored_blocks == 6
    assert index.ingest(engine.batch(engine.stored(prompt, 6, 10))).stored_blocks == 4
    chain = block_hashes_for(prompt, BLOCK)
    assert index.match(chain) == {"a": 10}
    assert index.match(engine_hashes(chain)) == {}
    assert index.match_tokens(prompt + [1, 2]) == {"a": 10}


def test_partial_overlap_counts_leading_blocks_per_worker() -> None:
    a, b = FakeEngine("a"), FakeEngine("b")
    shared = tokens(3, 6 * BLOCK)
    prompt_a = shared + tokens(4, 4 * BLOCK)
    prompt_b = shared[:3 * BLOCK] + tokens(5, 5 * BLOCK)
    index = index_with(a, b)
    index.ingest(a.batch(a.stored(prompt_a)))
    index.ingest(b.batch(b.stored(prompt_b)))
    request = shared + tokens(6, 8 * BLOCK)  # diverges from a after 6 blocks, from b after 3
    assert index.match(block_hashes_for(request, BLOCK)) == {"a": 6, "b": 3}
    assert index.match(block_hashes_for(prompt_a, BLOCK)) == {"a": 10, "b": 3}
    assert index.match(block_hashes_for(tokens(7, 8 * BLOCK), BLOCK)) == {}
    assert index.match([]) == {}
    assert index.stats().total_blocks == 10 + 5  # 3 shared blocks are counted once


# ---- sequence numbers, gaps, snapshots ---------------------------------------------------------


def test_a_sequence_gap_applies_the_batch_and_asks_for_one_resync() -> None:
    engine = FakeEngine("a")
    prompt = tokens(8, 6 * BLOCK)
    index = index_with(engine)
    first = index.ingest(engine.batch(engine.stored(prompt, 0, 2)))
    assert (first.outcome, first.synced, first.resync_needed) == (IngestOutcome.APPLIED, True, False)

    gapped = index.ingest(engine.batch(engine.stored(prompt, 2, 4), seq=5))  # 2, 3, 4 were lost
    assert (gapped.outcome, gapped.synced, gapped.resync_needed) == (IngestOutcome.GAP, False, True)
    assert gapped.stored_blocks == 2  # applied anyway: the best view there is
    assert index.match(block_hashes_for(prompt, BLOCK)) == {"a": 4}

    following = index.ingest(engine.batch(engine.stored(prompt, 4, 6)))
    assert (following.outcome, following.synced, following.resync_needed) == (IngestOutcome.APPLIED, False, False)
    assert index.unsynced_workers() == ["a"]
    assert index.stats().unsynced_workers == ("a",)


def test_a_restarted_worker_starting_over_at_seq_1_is_a_gap() -> None:
    engine = FakeEngine("a")
    index = index_with(engine)
    index.ingest(engine.batch(engine.stored(tokens(9, 2 * BLOCK))))
    index.ingest(engine.batch(engine.stored(tokens(10, 2 * BLOCK))))
    assert index.ingest(engine.batch(engine.stored(tokens(11, 2 * BLOCK)), seq=1)).resync_needed


def test_an_unknown_parent_is_a_gap_and_its_blocks_are_skipped() -> None:
    engine = FakeEngine("a")
    prompt = tokens(12, 6 * BLOCK)
    index = index_with(engine)
    result = index.ingest(engine.batch(engine.stored(prompt, 3, 6)))  # blocks 0-2 never announced
    assert (result.outcome, result.resync_needed, result.orphaned_blocks) == (IngestOutcome.GAP, True, 3)
    assert index.stats().total_blocks == 0


def test_a_snapshot_replaces_the_workers_view_and_resyncs_it() -> None:
    engine = FakeEngine("a")
    stale, kept = tokens(13, 4 * BLOCK), tokens(14, 4 * BLOCK)
    index = index_with(engine)
    index.ingest(engine.batch(engine.stored(stale), engine.stored(kept)))
    assert index.ingest(engine.batch(engine.removed(stale, 3), seq=7)).resync_needed  # missed batches

    # The worker answers the KvSnapshotRequest on its stream: cleared, then all it holds.
    snapshot = index.ingest(engine.batch(AllBlocksCleared(), engine.stored(kept)))
    assert (snapshot.outcome, snapshot.synced, snapshot.resync_needed) == (IngestOutcome.APPLIED, True, False)
    assert index.match(block_hashes_for(stale, BLOCK)) == {}
    assert index.match(block_hashes_for(kept, BLOCK)) == {"a": 4}
    assert index.unsynced_workers() == []
    assert index.stats().blocks_per_worker == {"a": 4}


def test_a_snapshot_block_whose_parent_was_evicted_is_skipped_without_another_resync() -> None:
    engine = FakeEngine("a")
    prompt = tokens(15, 5 * BLOCK)
    index = index_with(engine)
    result = index.ingest(engine.batch(AllBlocksCleared(), engine.stored(prompt, 0, 2), engine.stored(prompt, 3, 5)))
    assert (result.outcome, result.synced, result.resync_needed) == (IngestOutcome.APPLIED, True, False)
    assert (result.stored_blocks, result.orphaned_blocks) == (2, 2)
    assert index.match(block_hashes_for(prompt, BLOCK)) == {"a": 2}


def test_a_gapped_batch_that_holds_a_snapshot_is_in_sync() -> None:
    engine = FakeEngine("a")
    index = index_with(engine)
    result = index.ingest(engine.batch(AllBlocksCleared(), engine.stored(tokens(16, 2 * BLOCK)), seq=40))
    assert (result.outcome, result.synced, result.resync_needed) == (IngestOutcome.APPLIED, True, False)


def test_batches_of_unknown_workers_are_ignored() -> None:
    engine = FakeEngine("ghost")
    result = KvIndex().ingest(engine.batch(engine.stored(tokens(17, 2 * BLOCK))))
    assert result.outcome is IngestOutcome.UNKNOWN_WORKER and not result.resync_needed


def test_a_block_size_mismatch_is_rejected_and_counted() -> None:
    engine = FakeEngine("a", block_size=8)
    index = KvIndex()
    index.add_worker("a", BLOCK)  # membership says 4, the engine announces 8-token blocks
    result = index.ingest(engine.batch(engine.stored(tokens(18, 16))))
    assert (result.rejected_blocks, result.stored_blocks) == (2, 0)
    assert index.stats().workers[0].rejected_blocks == 2


# ---- removal and purge --------------------------------------------------------------------------


def test_removal_by_engine_hash_shortens_the_overlap() -> None:
    engine = FakeEngine("a")
    prompt = tokens(19, 6 * BLOCK)
    index = index_with(engine)
    index.ingest(engine.batch(engine.stored(prompt)))
    result = index.ingest(engine.batch(engine.removed(prompt, 5, 4)))
    assert result.removed_blocks == 2
    assert index.match(block_hashes_for(prompt, BLOCK)) == {"a": 4}
    again = index.ingest(engine.batch(engine.removed(prompt, 5), BlockRemoved(block_hashes=[42])))
    assert again.removed_blocks == 0 and again.synced  # removals are idempotent
    assert index.stats().blocks_per_worker == {"a": 4}


def test_a_block_another_worker_still_holds_survives_a_removal() -> None:
    a, b = FakeEngine("a"), FakeEngine("b")
    prompt = tokens(20, 3 * BLOCK)
    index = index_with(a, b)
    index.ingest(a.batch(a.stored(prompt)))
    index.ingest(b.batch(b.stored(prompt)))
    index.ingest(a.batch(a.removed(prompt, 0, 1, 2)))
    assert index.match(block_hashes_for(prompt, BLOCK)) == {"b": 3}


def test_a_re_announced_block_is_idempotent() -> None:
    engine = FakeEngine("a")
    prompt = tokens(21, 4 * BLOCK)
    index = index_with(engine)
    index.ingest(engine.batch(engine.stored(prompt, 0, 3)))
    assert index.ingest(engine.batch(engine.stored(prompt, 0, 4))).stored_blocks == 1  # a prefix hit, re-announced
    assert index.ingest(engine.batch(engine.stored(prompt))).stored_blocks == 0
    index.ingest(engine.batch(engine.removed(prompt, 0, 1, 2, 3)))
    assert index.match(block_hashes_for(prompt, BLOCK)) == {}
    assert index.stats().total_blocks == 0


def test_two_engine_hashes_for_the_same_tokens_hold_the_block_until_both_go() -> None:
    engine = FakeEngine("a")
    prompt = tokens(22, 2 * BLOCK)
    index = index_with(engine)
    index.ingest(engine.batch(engine.stored(prompt)))
    # e.g. a LoRA adapter: the engine hashes it into its keys, Tandem does not.
    other = BlockStored(block_hashes=[101, 102], parent_block_hash=None, token_ids=prompt, block_size=BLOCK)
    index.ingest(engine.batch(other))
    assert index.stats().blocks_per_worker == {"a": 2}
    index.ingest(engine.batch(engine.removed(prompt, 0, 1)))
    assert index.match(block_hashes_for(prompt, BLOCK)) == {"a": 2}
    index.ingest(engine.batch(BlockRemoved(block_hashes=[101, 102])))
    assert index.match(block_hashes_for(prompt, BLOCK)) == {}

    index.ingest(engine.batch(engine.stored(prompt), other))
    index.ingest(engine.batch(AllBlocksCleared()))  # each block once, however many engine hashes
    assert index.stats().total_blocks == 0


def test_all_blocks_cleared_and_remove_worker_purge_the_worker() -> None:
    a, b = FakeEngine("a"), FakeEngine("b")
    prompt = tokens(23, 4 * BLOCK)
    chain = block_hashes_for(prompt, BLOCK)
    index = index_with(a, b)
    index.ingest(a.batch(a.stored(prompt)))
    index.ingest(b.batch(b.stored(prompt, 0, 2)))
    index.ingest(a.batch(AllBlocksCleared()))
    assert index.match(chain) == {"b": 2}
    index.remove_worker("b")
    assert index.match(chain) == {}
    assert index.stats().total_blocks == 0
    assert index.workers() == ["a"]
    assert index.ingest(b.batch(b.stored(prompt))).outcome is IngestOutcome.UNKNOWN_WORKER

    index.add_worker("c", BLOCK)  # reuses b's slot: nothing of b's may show up as c's
    assert index.match(chain) == {}
    index.remove_worker("missing")  # a no-op


def test_adding_a_known_worker_with_another_block_size_starts_it_over() -> None:
    engine = FakeEngine("a")
    prompt = tokens(24, 4 * BLOCK)
    index = index_with(engine)
    index.ingest(engine.batch(engine.stored(prompt)))
    index.add_worker("a", BLOCK)  # same config: a no-op
    assert index.match(block_hashes_for(prompt, BLOCK)) == {"a": 4}
    index.add_worker("a", 2 * BLOCK)
    assert index.match(block_hashes_for(prompt, BLOCK)) == {}
    assert index.stats().workers[0].block_size == 2 * BLOCK


# ---- speculation --------------------------------------------------------------------------------


def test_speculative_blocks_count_until_they_expire() -> None:
    index = index_with(FakeEngine("a"), FakeEngine("b"))
    chain = block_hashes_for(tokens(25, 6 * BLOCK), BLOCK)
    assert index.add_speculative("a", chain, expires_at=10.0) == 6
    assert index.match(chain) == {"a": 6}
    assert index.stats().workers[0].speculative_blocks == 6
    assert index.expire(now=9.9) == 0
    assert index.expire(now=10.0) == 6
    assert index.match(chain) == {}
    assert index.stats().total_blocks == 0
    assert index.add_speculative("ghost", chain, expires_at=1.0) == 0


def test_a_real_block_supersedes_a_speculative_one() -> None:
    engine = FakeEngine("a")
    prompt = tokens(26, 6 * BLOCK)
    chain = block_hashes_for(prompt, BLOCK)
    index = index_with(engine)
    index.add_speculative("a", chain, expires_at=5.0)
    index.ingest(engine.batch(engine.stored(prompt, 0, 4)))  # the prefill announced 4 blocks so far
    assert index.match(chain) == {"a": 6}
    assert index.expire(now=5.0) == 2  # only the 2 still speculative
    assert index.match(chain) == {"a": 4}
    index.ingest(engine.batch(engine.removed(prompt, 3)))
    assert index.match(chain) == {"a": 3}
    assert index.add_speculative("a", chain[:3], expires_at=9.0) == 0  # really held: nothing to predict


def test_held_prefix_stops_at_the_first_predicted_block() -> None:
    engine = FakeEngine("a")
    prompt = tokens(29, 6 * BLOCK)
    chain = block_hashes_for(prompt, BLOCK)
    index = index_with(engine, FakeEngine("b"))
    index.ingest(engine.batch(engine.stored(prompt, 0, 2)))
    index.add_speculative("a", chain, expires_at=5.0)
    assert index.match(chain) == {"a": 6}
    assert index.held_prefix("a", chain, 6) == 2  # what "a" could lend now
    index.ingest(engine.batch(engine.stored(prompt, 2, 6)))
    assert index.held_prefix("a", chain, 6) == 6
    assert index.held_prefix("b", chain, 0) == 0 and index.held_prefix("ghost", chain, 6) == 0


def test_a_later_prediction_extends_an_earlier_one() -> None:
    index = index_with(FakeEngine("a"))
    chain = block_hashes_for(tokens(27, 4 * BLOCK), BLOCK)
    index.add_speculative("a", chain[:2], expires_at=5.0)
    assert index.add_speculative("a", chain, expires_at=8.0) == 2
    assert index.expire(now=6.0) == 0
    assert index.match(chain) == {"a": 4}
    assert index.expire(now=8.0) == 4


def test_speculation_survives_a_snapshot_and_dies_with_the_worker() -> None:
    engine = FakeEngine("a")
    chain = block_hashes_for(tokens(28, 3 * BLOCK), BLOCK)
    index = index_with(engine)
    index.add_speculative("a", chain, expires_at=5.0)
    index.ingest(engine.batch(AllBlocksCleared()))  # the request is still in flight there
    assert index.match(chain) == {"a": 3}
    index.remove_worker("a")
    assert index.match(chain) == {}
    index.add_worker("a", BLOCK)
    assert index.expire(now=6.0) == 0  # the old worker's entries are gone with it
    assert index.stats().total_blocks == 0


# ---- block sizes and salts ------------------------------------------------------------------------


def test_workers_with_different_block_sizes_match_their_own_chains() -> None:
    small, large = FakeEngine("small", block_size=4), FakeEngine("large", block_size=8)
    prompt = tokens(29, 32)
    index = index_with(small, large)
    index.ingest(small.batch(small.stored(prompt)))
    index.ingest(large.batch(large.stored(prompt)))
    assert index.match(block_hashes_for(prompt, 4)) == {"small": 8}
    assert index.match(block_hashes_for(prompt, 8)) == {"large": 4}
    assert index.match_tokens(prompt[:20]) == {"small": 5, "large": 2}


def test_a_salt_separates_workers_that_hold_the_same_tokens() -> None:
    plain, salted = FakeEngine("plain"), FakeEngine("salted", salt=b"tenant-1")
    prompt = tokens(30, 4 * BLOCK)
    index = index_with(plain, salted)
    index.ingest(plain.batch(plain.stored(prompt)))
    index.ingest(salted.batch(salted.stored(prompt)))
    assert index.match(block_hashes_for(prompt, BLOCK)) == {"plain": 4}
    assert index.match(block_hashes_for(prompt, BLOCK, b"tenant-1")) == {"salted": 4}
    assert index.match_tokens(prompt) == {"plain": 4, "salted": 4}


# ---- randomized: the index against a naive model ----------------------------------------------------


@pytest.mark.parametrize("chain_hashes", [False, True], ids=["token-ids", "chain-hashes"])
def test_random_stores_removals_and_clears_agree_with_a_naive_model(chain_hashes: bool) -> None:
    rng = random.Random(31)
    engines = [FakeEngine(f"w{index}", chain_hashes=chain_hashes) for index in range(5)]
    prompts = [tokens(100 + index, 12 * BLOCK) for index in range(6)]
    prompts += [prompts[0][:5 * BLOCK] + tokens(200 + index, 7 * BLOCK) for index in range(4)]  # shared prefixes
    chains = [block_hashes_for(prompt, BLOCK) for prompt in prompts]
    index = index_with(*engines)
    held: dict[str, set[int]] = {engine.worker_id: set() for engine in engines}
    for _ in range(400):
        engine = rng.choice(engines)
        worker_held = held[engine.worker_id]
        prompt_index = rng.randrange(len(prompts))
        prompt, chain = prompts[prompt_index], chains[prompt_index]
        action = rng.random()
        if action < 0.6:  # prefill: announce what is missing after the cached head, in chunks
            start = 0
            while start < len(chain) and chain[start] in worker_held:
                start += 1
            stop = min(len(chain), start + rng.randint(1, 6))
            if start < stop:
                index.ingest(engine.batch(engine.stored(prompt, start, stop)))
                worker_held.update(chain[start:stop])
        elif action < 0.95:  # evict a tail of one sequence, as LRU engines do
            cut = rng.randrange(len(chain))
            gone = [position for position in range(cut, len(chain)) if chain[position] in worker_held]
            if gone:
                index.ingest(engine.batch(engine.removed(prompt, *gone)))
                worker_held.difference_update(chain[position] for position in gone)
        else:
            index.ingest(engine.batch(AllBlocksCleared()))
            worker_held.clear()
        query = chains[rng.randrange(len(chains))]
        expected = {}
        for worker_id, blocks in held.items():
            overlap = 0
            while overlap < len(query) and query[overlap] in blocks:
                overlap += 1
            if overlap:
                expected[worker_id] = overlap
        assert index.match(query) == expected
    assert index.stats().blocks_per_worker == {worker_id: len(blocks) for worker_id, blocks in held.items()}
    assert index.stats().total_blocks == len(set().union(*held.values()))
    assert index.unsynced_workers() == []
