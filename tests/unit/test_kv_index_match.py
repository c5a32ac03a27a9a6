"""`KvIndex.match` by bisection (`trust_chains`, `kv.index_runs`) against a naive reference on
plain data: per worker, the leading blocks of the chain it holds, block by block."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.router.kv.index import KvIndex
from services.router.kv.index_match import drop_points
from shared.block_hash import block_hash_chain
from shared.schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch

WORKERS = ("a", "b", "c")
# A small tree of prompts (block size 1): shared heads, so workers hold overlapping chains.
PROMPTS = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 9], [1, 10, 11, 12], [13, 14, 15], [1, 2, 3, 4, 16, 17]]
CHAINS = [block_hash_chain(prompt, 1) for prompt in PROMPTS]


def engine_hash(block_hash: int, variant: int = 0) -> int:
    return (block_hash * 0x9E3779B97F4A7C15 + 7 + variant) % 2**64


def reference(index: KvIndex, chain: list[int]) -> dict[str, int]:
    overlaps = {}
    for worker_id in index.workers():
        held = 0
        while held < len(chain) and index.holds(worker_id, chain[held]):
            held += 1
        if held:
            overlaps[worker_id] = held
    return overlaps


def stored(prompt: int, start: int, stop: int, *, chain_hashes: bool, variant: int = 0) -> BlockStored:
    chain = CHAINS[prompt]
    return BlockStored(block_hashes=[engine_hash(block, variant) for block in chain[start:stop]],
                       parent_block_hash=engine_hash(chain[start - 1]) if start else None,
                       token_ids=PROMPTS[prompt][start:stop], block_size=1,
                       chain_hashes=chain[start:stop] if chain_hashes else None)


operation = st.tuples(
    st.sampled_from(["store", "store", "store", "remove", "remove", "clear", "snapshot", "speculate", "expire",
                     "rejoin", "duplicate"]),
    st.sampled_from(WORKERS), st.integers(0, len(PROMPTS) - 1), st.integers(0, 6), st.integers(0, 6),
    st.booleans(), st.randoms(use_true_random=False))


@settings(max_examples=400, deadline=None)
@given(st.lists(operation, max_size=40))
def test_match_equals_the_naive_reference_under_random_events(operations) -> None:
    index = KvIndex(trust_chains=True)
    for worker_id in WORKERS:
        index.add_worker(worker_id, 1)
    seq = dict.fromkeys(WORKERS, 0)
    now = 0.0

    def send(worker_id: str, *events: KvEvent) -> None:
        seq[worker_id] += 1
        index.ingest(KvEventBatch(worker_id=worker_id, seq=seq[worker_id], ts=0.0, events=list(events)))

    for kind, worker_id, prompt, first, second, flag, rng in operations:
        chain = CHAINS[prompt]
        start = max(0, first - 3)  # mostly from the root; else under a parent the worker may not hold
        stop = max(start, len(chain) - second % 3)
        if kind == "store" and start < stop:  # its parent may be one the worker does not hold
            send(worker_id, stored(prompt, start, stop, chain_hashes=flag))
        elif kind == "duplicate" and start < stop:  # the same blocks under other engine hashes
            send(worker_id, stored(prompt, start, stop, chain_hashes=True, variant=1))
        elif kind == "remove":  # any blocks, mid-chain too, in any order
            positions = list(range(len(chain)))
            rng.shuffle(positions)
            removed = [engine_hash(chain[position], variant) for position in positions[:1 + first % 3]
                       for variant in ((0, 1) if flag else (0,))]
            send(worker_id, BlockRemoved(block_hashes=removed))
        elif kind == "clear":
            send(worker_id, AllBlocksCleared())
        elif kind == "snapshot":  # a clear, then runs of several prompts (a parent may be missing)
            runs = [stored(other, rng.randint(0, 1) if flag else 0, len(CHAINS[other]), chain_hashes=True)
                    for other in sorted(rng.sample(range(len(PROMPTS)), 1 + first % 3))]
            send(worker_id, AllBlocksCleared(), *runs)
        elif kind == "speculate":
            index.add_speculative(worker_id, chain[:stop], expires_at=now + 1 + first % 3)
        elif kind == "expire":
            now += first % 3
            index.expire(now)
        elif kind == "rejoin":
            index.remove_worker(worker_id)
            index.add_worker(worker_id, 1)
            seq[worker_id] = 0
        open_bits = index._open.mask  # kept in step with the workers' runs
        assert sorted(index.open_workers()) == [worker_id for worker_id in WORKERS
                                                if open_bits >> index._workers[worker_id].slot & 1]
        for query in CHAINS:
            expected = reference(index, query)
            assert index.match(query) == expected
            assert index._match_linear(query) == expected
        assert index.match([]) == {}


def test_without_trust_chains_match_scans_linearly() -> None:
    """A worker's wrong chain hash in mid-chain: what the index holds is what `match` counts,
    unless the chains are trusted to be Tandem chains (each hash covers its prefix)."""
    chain = CHAINS[0]
    event = stored(0, 0, len(chain), chain_hashes=True)
    event.chain_hashes = [*chain[:2], 12345, *chain[3:]]
    for trust, overlap in ((False, 2), (True, len(chain))):
        index = KvIndex(trust_chains=trust)
        index.add_worker("a", 1)
        index.ingest(KvEventBatch(worker_id="a", seq=1, ts=0.0, events=[event]))
        assert index.match(chain) == {"a": overlap}


def test_drop_points_bisect_a_monotone_chain() -> None:
    masks = {0: 0b111, 1: 0b111, 2: 0b011, 3: 0b011, 4: 0b001, 5: 0b001, 6: 0b001, 7: 0}
    assert drop_points(masks.get, list(range(8)), 0b111) == [(2, 0b100), (4, 0b010), (7, 0b001)]
    assert drop_points(masks.get, [0], 0b111) == [(1, 0b111)]
    assert drop_points(masks.get, [0, 1], 0b111) == [(2, 0b111)]


def trusted_index(*events: KvEvent) -> KvIndex:
    index = KvIndex(trust_chains=True)
    index.add_worker("a", 1)
    for seq, event in enumerate(events, 1):
        index.ingest(KvEventBatch(worker_id="a", seq=seq, ts=0.0, events=[event]))
    return index


def removed(prompt: int, *positions: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=[engine_hash(CHAINS[prompt][position]) for position in positions])


def test_dropping_a_tail_that_another_run_hangs_under_is_no_leaf() -> None:
    index = trusted_index(stored(2, 0, 2, chain_hashes=True), stored(2, 2, 3, chain_hashes=True), removed(2, 1))
    assert index.match(CHAINS[2]) == reference(index, CHAINS[2]) == {"a": 1}


def test_a_chain_evicted_parent_first_in_one_event_keeps_the_worker_closed() -> None:
    gone = removed(0, 3, 4, 5, 1, 2).block_hashes + removed(5, 4, 5).block_hashes  # 5's run hangs under 0's block 3
    index = trusted_index(stored(0, 0, 6, chain_hashes=True), stored(5, 4, 6, chain_hashes=True),
                          BlockRemoved(block_hashes=gone))
    assert index.match(CHAINS[5]) == reference(index, CHAINS[5]) == {"a": 1}
    assert index._open.mask == 0  # every drop was a leaf once the others had gone


def test_a_prediction_under_an_evicted_real_block_opens_the_worker() -> None:
    index = trusted_index(stored(0, 0, 3, chain_hashes=True))
    index.add_speculative("a", CHAINS[0], expires_at=10.0)  # blocks 3-5 hang under the real block 2
    index.ingest(KvEventBatch(worker_id="a", seq=2, ts=0.0, events=[removed(0, 2)]))
    assert index.match(CHAINS[0]) == reference(index, CHAINS[0]) == {"a": 2}
    index.expire(10.0)
    index.ingest(KvEventBatch(worker_id="a", seq=3, ts=0.0, events=[AllBlocksCleared()]))
    assert index._open.mask == 0  # a clear closes it again


def test_a_snapshot_rebuilds_the_runs() -> None:
    index = trusted_index(stored(0, 0, 6, chain_hashes=True))
    index.ingest(KvEventBatch(worker_id="a", seq=2, ts=0.0, events=[
        AllBlocksCleared(), stored(0, 0, 4, chain_hashes=True), stored(1, 3, 5, chain_hashes=True)]))
    assert index._open.mask == 0
    assert index.match(CHAINS[1]) == {"a": 5}
    index.ingest(KvEventBatch(worker_id="a", seq=3, ts=0.0, events=[removed(0, 3)]))  # block 3 of prompt 0: a leaf
    assert index._open.mask == 0
    assert index.match(CHAINS[0]) == {"a": 3}
    index.ingest(KvEventBatch(worker_id="a", seq=4, ts=0.0, events=[removed(0, 2)]))  # prompt 1's run hangs under it
    assert index._open.mask != 0
    assert index.open_workers() == ["a"]
    assert index.match(CHAINS[1]) == reference(index, CHAINS[1]) == {"a": 2}
