"""The router's KV batch decoding (`services.router.kv.batch_decode`): batches whose stored
events carry usable chains are decoded without token ids and leave the index as the full
decode does; an event without a chain, or with one of the wrong length, and verification
mode decode the batch in full; the metrics collector's view reads batches without token ids."""

from __future__ import annotations

import random

import msgspec
import pytest

from services.metrics.cluster_view import ClusterView
from services.router.kv.batch_decode import KvBatchDecoder, needs_token_ids
from services.router.kv.index import KvIndex, block_hashes_for
from shared.codec import Codec, MalformedCounter, encode
from shared.schemas.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStoredWithoutTokens,
    KvEventBatch,
    KvEventBatchWithoutTokens,
)
from tests.unit.test_cluster_view import registration
from tests.unit.test_kv_index import BLOCK, FakeEngine, tokens
from tests.unit.test_kv_index_hashes import wrong_at

SUBJECT = "kv.events.a"


class UnreadTokens(list):
    """Token ids that fail the test if the index reads them."""

    def __len__(self) -> int:
        raise AssertionError("the token ids were read")

    def __getitem__(self, item):  # type: ignore[no-untyped-def]
        raise AssertionError("the token ids were read")

    def __iter__(self):  # type: ignore[no-untyped-def]
        raise AssertionError("the token ids were read")


def router_index(*engines: FakeEngine, verify_hashes: bool = False) -> KvIndex:
    index = KvIndex(verify_hashes=verify_hashes, trust_chains=True)  # as `ModelKv` builds it
    for engine in engines:
        index.add_worker(engine.worker_id, engine.block_size, engine.salt)
    return index


def index_state(index: KvIndex) -> tuple:
    """Everything ingest changes: holder masks, each worker's tables, runs and counters, and sync."""
    workers = {worker_id: (worker.tandem_of, worker.extra_refs, worker.runs.closed, dict(worker.runs.tails),
                           worker.rejected_blocks, worker.orphaned_blocks, worker.mismatched_blocks,
                           worker.unverified_blocks)
               for worker_id, worker in index._workers.items()}
    return index._holders, workers, index.stats()


def random_stream(seed: int, engines: list[FakeEngine]) -> list[KvEventBatch]:
    """Prefills in chunks with parent links, tail evictions, clears and snapshots, over shared prefixes."""
    rng = random.Random(seed)
    prompts = [tokens(100 + number, 12 * BLOCK) for number in range(5)]
    prompts += [prompts[0][:5 * BLOCK] + tokens(200 + number, 7 * BLOCK) for number in range(3)]
    held: dict[str, set[int]] = {engine.worker_id: set() for engine in engines}
    batches = []
    for _ in range(300):
        engine = rng.choice(engines)
        prompt = rng.choice(prompts)
        chain = block_hashes_for(prompt, BLOCK)
        worker_held = held[engine.worker_id]
        action = rng.random()
        if action < 0.6:
            start = 0
            while start < len(chain) and chain[start] in worker_held and rng.random() > 0.05:
                start += 1  # now and then held blocks are announced again, as vLLM does
            stop = min(len(chain), start + rng.randint(1, 6))
            if start < stop:
                batches.append(engine.batch(engine.stored(prompt, start, stop)))
                worker_held.update(chain[start:stop])
        elif action < 0.9:
            gone = [position for position in range(rng.randrange(len(chain)), len(chain))
                    if chain[position] in worker_held]
            batches.append(engine.batch(engine.removed(prompt, *gone)))
            worker_held.difference_update(chain[position] for position in gone)
        elif action < 0.95:
            batches.append(engine.batch(AllBlocksCleared()))
            worker_held.clear()
        else:  # a snapshot: the clear, then what the worker holds, prompt by prompt
            events = [engine.stored(each) for each in prompts if set(block_hashes_for(each, BLOCK)) <= worker_held]
            batches.append(engine.batch(AllBlocksCleared(), *events))
            worker_held.clear()
            for event in events:
                worker_held.update(event.chain_hashes or [])
    return batches


# ---- without token ids ----------------------------------------------------------------------------


def test_batches_with_chains_decode_without_token_ids_into_the_same_index() -> None:
    engines = [FakeEngine(f"w{number}", chain_hashes=True) for number in range(4)]
    batches = random_stream(5, engines)
    full, lean = router_index(*engines), router_index(*engines)
    decoder = KvBatchDecoder()
    full_decoder = msgspec.msgpack.Decoder(KvEventBatch)
    for batch in batches:
        decoded = decoder.decode_or_none(encode(batch), SUBJECT)
        assert type(decoded) is KvEventBatchWithoutTokens
        assert full.ingest(full_decoder.decode(encode(batch))) == lean.ingest(decoded)
    assert index_state(lean) == index_state(full)
    assert sum(index_state(lean)[2].blocks_per_worker.values()) > 0
    assert decoder.malformed.total == 0


def test_a_chain_used_as_sent_leaves_the_token_ids_unread() -> None:
    engine = FakeEngine("a", chain_hashes=True)
    prompt = tokens(1, 6 * BLOCK)
    stored = engine.stored(prompt)
    stored.token_ids = UnreadTokens(stored.token_ids)
    index = router_index(engine)
    assert index.ingest(engine.batch(stored)).stored_blocks == 6
    assert index.match(block_hashes_for(prompt, BLOCK)) == {"a": 6}


def test_removals_and_clears_decode_as_sent() -> None:
    engine = FakeEngine("a", chain_hashes=True)
    events = [BlockRemoved(block_hashes=[1, 2 ** 64 - 1]), AllBlocksCleared(), BlockRemoved(block_hashes=[])]
    batch = KvBatchDecoder().decode_or_none(encode(engine.batch(*events, seq=7)), SUBJECT)
    assert type(batch) is KvEventBatchWithoutTokens
    assert (batch.worker_id, batch.seq, batch.events) == ("a", 7, events)


def test_a_stored_event_without_token_ids_decodes_without_them() -> None:
    engine = FakeEngine("a", chain_hashes=True)
    stored = engine.stored(tokens(2, 3 * BLOCK))
    batch = KvBatchDecoder().decode_or_none(encode(engine.batch(stored)), SUBJECT)
    assert batch is not None
    event = batch.events[0]
    assert type(event) is BlockStoredWithoutTokens and event.token_ids == ()
    assert (event.block_hashes, event.parent_block_hash, event.block_size, event.chain_hashes) == (
        stored.block_hashes, stored.parent_block_hash, stored.block_size, stored.chain_hashes)


# ---- in full ----------------------------------------------------------------------------------


@pytest.mark.parametrize("chain", ["none", "short", "long"])
def test_a_stored_event_without_a_usable_chain_decodes_its_batch_in_full(chain: str) -> None:
    engine = FakeEngine("a", chain_hashes=True)
    first, second = tokens(3, 4 * BLOCK), tokens(4, 4 * BLOCK)
    unusable = engine.stored(second)
    assert unusable.chain_hashes is not None
    unusable.chain_hashes = {"none": None, "short": unusable.chain_hashes[:-1],
                             "long": [*unusable.chain_hashes, 1]}[chain]
    sent = engine.batch(engine.stored(first), unusable, BlockRemoved(block_hashes=[5]))
    batch = KvBatchDecoder().decode_or_none(encode(sent), SUBJECT)
    assert batch == sent  # every event decoded with its token ids
    index = router_index(engine)
    assert index.ingest(batch).stored_blocks == 8
    assert index.match(block_hashes_for(second, BLOCK)) == {"a": 4}  # hashed from the token ids


def test_needs_token_ids_only_for_a_stored_event_without_a_usable_chain() -> None:
    def lean(*events: object) -> KvEventBatchWithoutTokens:
        return KvEventBatchWithoutTokens(worker_id="a", seq=1, ts=0.0, events=list(events))  # type: ignore[arg-type]

    def stored(chain: list[int] | None) -> BlockStoredWithoutTokens:
        return BlockStoredWithoutTokens(block_hashes=[1, 2], parent_block_hash=None, block_size=BLOCK,
                                        chain_hashes=chain)

    assert not needs_token_ids(lean())
    assert not needs_token_ids(lean(AllBlocksCleared(), BlockRemoved(block_hashes=[1]), stored([3, 4])))
    assert needs_token_ids(lean(stored([3, 4]), stored(None)))
    assert needs_token_ids(lean(stored([3])))


def test_verification_decodes_in_full_and_counts_mismatches_as_before() -> None:
    engine = FakeEngine("a", chain_hashes=True)
    prompt = tokens(5, 4 * BLOCK)
    sent = engine.batch(wrong_at(engine.stored(prompt), 2))
    batch = KvBatchDecoder(verify_hashes=True).decode_or_none(encode(sent), SUBJECT)
    assert type(batch) is KvEventBatch and batch == sent
    index = router_index(engine, verify_hashes=True)
    assert index.ingest(batch).mismatched_blocks == 1
    assert index.stats().mismatched_blocks == 1
    assert index.match(block_hashes_for(prompt, BLOCK)) == {"a": 4}  # the router's chain is indexed


def test_an_event_without_token_ids_is_unverified_in_verification_mode() -> None:
    engine = FakeEngine("a", chain_hashes=True)
    lean = msgspec.msgpack.decode(encode(engine.batch(engine.stored(tokens(6, 3 * BLOCK)))),
                                  type=KvEventBatchWithoutTokens)
    index = router_index(engine, verify_hashes=True)
    result = index.ingest(lean)
    assert (result.stored_blocks, result.mismatched_blocks) == (3, 0)
    assert index.stats().workers[0].unverified_blocks == 3  # as if sent without token ids


def test_a_malformed_batch_is_counted_once_and_dropped() -> None:
    malformed = MalformedCounter()
    decoder = KvBatchDecoder(malformed)
    assert decoder.decode_or_none(b"\xc1", SUBJECT) is None
    assert decoder.decode_or_none(encode(BlockRemoved(block_hashes=[1])), SUBJECT) is None
    assert malformed.by_subject[SUBJECT] == 2


# ---- the metrics collector --------------------------------------------------------------------


def test_the_cluster_view_counts_blocks_of_batches_decoded_without_token_ids() -> None:
    engine = FakeEngine("w1", chain_hashes=True)
    batches = random_stream(9, [engine])
    codecs: list[Codec] = [Codec(KvEventBatch), Codec(KvEventBatchWithoutTokens)]
    views = [ClusterView(), ClusterView()]
    for view in views:
        view.apply_registration(registration("w1"))
    for batch in batches:
        asks = [view.apply_kv(codec.decode(encode(batch))) for view, codec in zip(views, codecs)]
        assert asks[0] == asks[1]
    full, lean = (view.snapshot().workers[0] for view in views)
    assert full == lean and full.kv_stored_blocks > 0
