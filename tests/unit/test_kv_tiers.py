"""KV tiers the router can see, on plain data: the index keeps each (worker, block)'s tier
from the events, the model's namespace credits or (tier-blind) drops blocks outside the
first tier, and the cost model charges a host-tier hit its load: less than a miss, more
than a first-tier hit."""

from __future__ import annotations

import dataclasses

import pytest

from services.router.config import RoutingConfig
from services.router.kv.index import KvIndex
from services.router.kv.model_kv import ModelKv, tiered_prefix
from services.router.routing import RoutePlan, RouteRequest, decide
from services.router.routing.calibration import host_load_weight
from services.router.routing.cost import PrefillPlan, prefill_cost, tier_load_cost
from shared.block_hash import block_hash_chain
from shared.schemas import kv_events
from tests.unit.worker_views import worker_view

BLOCK = 4
PROMPT = list(range(100, 100 + 8 * BLOCK))  # 8 full blocks
CHAIN = block_hash_chain(PROMPT, BLOCK)


def stored(start: int, stop: int, tier: str = "device") -> kv_events.BlockStored:
    """Blocks [start, stop) of PROMPT as a worker that sends Tandem's chain (engine hash == chain hash)."""
    return kv_events.BlockStored(block_hashes=CHAIN[start:stop], parent_block_hash=CHAIN[start - 1] if start else None,
                                 token_ids=PROMPT[start * BLOCK:stop * BLOCK], block_size=BLOCK,
                                 chain_hashes=CHAIN[start:stop], tier=tier)  # type: ignore[arg-type]


class Worker:
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.seq = 0

    def batch(self, *events: kv_events.KvEvent) -> kv_events.KvEventBatch:
        self.seq += 1
        return kv_events.KvEventBatch(worker_id=self.worker_id, seq=self.seq, ts=0.0, events=list(events))


# ---- the index's tier bookkeeping -----------------------------------------------------------


def test_moved_blocks_keep_matching_and_the_index_knows_their_tier() -> None:
    index = KvIndex(trust_chains=True)
    index.add_worker("w", BLOCK)
    worker = Worker("w")
    index.ingest(worker.batch(stored(0, 8)))
    assert index.tiers("w") == {}
    result = index.ingest(worker.batch(kv_events.BlocksMoved(block_hashes=CHAIN[5:8], tier="host")))
    assert result.moved_blocks == 3 and index.match(CHAIN) == {"w": 8}
    assert index.tiers("w") == {block_hash: "host" for block_hash in CHAIN[5:8]}
    index.ingest(worker.batch(kv_events.BlocksMoved(block_hashes=CHAIN[5:6], tier="device")))  # loaded back
    assert set(index.tiers("w")) == set(CHAIN[6:8])
    index.ingest(worker.batch(kv_events.BlockRemoved(block_hashes=CHAIN[7:8])))  # left every tier
    assert index.match(CHAIN) == {"w": 7} and set(index.tiers("w")) == {CHAIN[6]}
    index.ingest(worker.batch(kv_events.BlocksMoved(block_hashes=[12345], tier="host")))  # unknown: ignored
    assert set(index.tiers("w")) == {CHAIN[6]}


def test_stored_events_carry_a_tier_and_a_device_store_clears_it() -> None:
    index = KvIndex(trust_chains=True)
    index.add_worker("w", BLOCK)
    worker = Worker("w")
    index.ingest(worker.batch(stored(0, 4), stored(4, 8, tier="host")))
    assert set(index.tiers("w")) == set(CHAIN[4:8]) and index.match(CHAIN) == {"w": 8}
    index.ingest(worker.batch(kv_events.BlockRemoved(block_hashes=CHAIN[4:8]), stored(4, 6)))  # computed again
    assert index.tiers("w") == {} and index.match(CHAIN) == {"w": 6}


def test_a_snapshot_replaces_the_tiers_and_removal_of_the_worker_forgets_them() -> None:
    index = KvIndex(trust_chains=True)
    index.add_worker("w", BLOCK)
    worker = Worker("w")
    index.ingest(worker.batch(stored(0, 8)))
    index.ingest(worker.batch(kv_events.BlocksMoved(block_hashes=CHAIN[:8], tier="host")))
    index.ingest(worker.batch(kv_events.AllBlocksCleared(), stored(0, 8)))  # all in the first tier now (as a diff)
    assert index.tiers("w") == {} and index.match(CHAIN) == {"w": 8}
    index.ingest(worker.batch(kv_events.AllBlocksCleared(), stored(0, 2), stored(2, 8, tier="host")))
    assert set(index.tiers("w")) == set(CHAIN[2:8]) and index.match(CHAIN) == {"w": 8}
    index.remove_worker("w")
    assert index.tiers("w") == {}


# ---- the namespace: tier-aware and tier-blind ------------------------------------------------


def test_tiered_prefix_credits_or_cuts_blocks_outside_the_first_tier() -> None:
    tiers = {CHAIN[3]: "host", CHAIN[5]: "host", CHAIN[6]: "disk"}
    assert tiered_prefix(CHAIN, 8, 8, tiers, tier_aware=True) == (8, 3, {"host": 2, "disk": 1})
    assert tiered_prefix(CHAIN, 8, 8, tiers, tier_aware=False) == (3, 3, {})
    assert tiered_prefix(CHAIN, 3, 2, tiers, tier_aware=True) == (3, 2, {})
    # a worker that lends its host tier lends up to the first block in a slower tier still
    assert tiered_prefix(CHAIN, 8, 8, tiers, tier_aware=True, lends_host_tier=True) == (8, 6, {"host": 2, "disk": 1})
    assert tiered_prefix(CHAIN, 8, 4, tiers, tier_aware=True, lends_host_tier=True)[1] == 4  # only what it reported
    assert tiered_prefix(CHAIN, 8, 8, tiers, tier_aware=False, lends_host_tier=True) == (3, 3, {})  # blind: as gone


@pytest.mark.parametrize("tier_aware", [True, False])
def test_prompt_cache_reports_host_tokens_or_hides_them(tier_aware: bool) -> None:
    kv = ModelKv(tier_aware=tier_aware)
    kv.worker_joined("w", BLOCK)
    worker = Worker("w")
    kv.index.ingest(worker.batch(stored(0, 8)))
    kv.index.ingest(worker.batch(kv_events.BlocksMoved(block_hashes=CHAIN[:8], tier="host")))
    cache = kv.prompt_cache(PROMPT + [1, 2], now=0.0)
    if tier_aware:
        assert cache.cached_tokens == {"w": 32} and cache.tier_tokens == {"w": {"host": 32}}
    else:
        assert cache.cached_tokens == {} and cache.tier_tokens == {}
    assert cache.held_tokens.get("w", 0) == 0  # a pull reads the first tier only


def test_a_worker_that_lends_its_host_tier_is_a_pull_source_for_it() -> None:
    kv = ModelKv()
    kv.worker_joined("w", BLOCK, lends_host_tier=True)
    worker = Worker("w")
    kv.index.ingest(worker.batch(stored(0, 8)))
    kv.index.ingest(worker.batch(kv_events.BlocksMoved(block_hashes=CHAIN[4:8], tier="host")))
    cache = kv.prompt_cache(PROMPT + [1, 2], now=0.0)
    assert cache.cached_tokens == {"w": 32} and cache.held_tokens == {"w": 32}
    assert cache.tier_tokens == {"w": {"host": 16}}
    kv.worker_left("w")
    kv.worker_joined("w", BLOCK)  # a worker that does not lend it: a pull reads its first tier only
    worker = Worker("w")
    kv.index.ingest(worker.batch(stored(0, 8)))
    kv.index.ingest(worker.batch(kv_events.BlocksMoved(block_hashes=CHAIN[4:8], tier="host")))
    assert kv.prompt_cache(PROMPT + [1, 2], now=0.0).held_tokens == {"w": 16}


def test_without_tiers_prompt_cache_is_as_before() -> None:
    kv = ModelKv()
    kv.worker_joined("w", BLOCK)
    kv.index.ingest(Worker("w").batch(stored(0, 8)))
    cache = kv.prompt_cache(PROMPT + [1, 2], now=0.0)
    assert (cache.cached_tokens, cache.held_tokens, cache.tier_tokens) == ({"w": 32}, {"w": 32}, {})


# ---- the cost model's credit ----------------------------------------------------------------


def test_a_host_tier_hit_costs_its_load_between_a_hit_and_a_miss() -> None:
    routing = RoutingConfig(host_load_weight=0.2)
    view = worker_view("w")
    assert tier_load_cost(routing, {"host": 1000}) == pytest.approx(200)
    assert tier_load_cost(routing, {"disk": 1000}) == pytest.approx(1000)  # no engine reports disk: a miss's price
    assert tier_load_cost(routing, None) == 0
    device_hit = prefill_cost(routing, PrefillPlan("w", 1000, 0, None, 64), view)
    host_hit = prefill_cost(routing, PrefillPlan("w", 1000, 0, None, 64, tier_load_cost(routing, {"host": 1000})), view)
    miss = prefill_cost(routing, PrefillPlan("w", 0, 0, None, 1064), view)
    assert device_hit < host_hit < miss


def test_routing_prefers_a_first_tier_holder_over_a_host_tier_holder() -> None:
    # "a" would win a tie (the smallest id): only the load of its host-tier copy makes "b" cheaper
    workers = [worker_view(name, max_num_seqs=64, max_model_len=4096) for name in ("a", "b")]
    route = RouteRequest(model="m", prompt_tokens=1100, total_tokens=1116,
                         cached_tokens={"a": 1024, "b": 1024}, held_tokens={"b": 1024},
                         tier_tokens={"a": {"host": 1024}})
    decision = decide(workers, route, RoutingConfig())
    assert isinstance(decision, RoutePlan) and decision.worker_id == "b"
    blind = decide(workers, dataclasses.replace(route, tier_tokens={}), RoutingConfig())
    assert isinstance(blind, RoutePlan) and blind.worker_id == "a"


def test_the_load_weight_is_the_measured_ratio_of_a_load_to_a_prefill() -> None:
    assert host_load_weight(0.05, 0.01) == pytest.approx(0.2)
    RoutingConfig(host_load_weight=host_load_weight(0.05, 0.01)).validate()
    with pytest.raises(ValueError):
        host_load_weight(0.0, 0.01)




def test_a_host_tier_hit_takes_first_tier_room_like_computed_tokens() -> None:
    from services.router.routing.cost import Holders, plan_prefill

    routing = RoutingConfig(host_load_weight=0.2, eviction_weight=0.5)
    full = worker_view("w", kv_capacity_tokens=2048, reported_free_kv_tokens=0)
    plan = plan_prefill(full, 1100, {"w": 1024}, Holders([], {}), {"host": 1024}, routing)
    assert (plan.loaded_tokens, plan.load_cost, plan.uncached_tokens) == (1024, pytest.approx(204.8), 76)
    device_plan = plan_prefill(full, 1100, {"w": 1024}, Holders([], {}))
    # loading evicts 1024 more tokens from the full first tier than a first-tier hit does
    assert prefill_cost(routing, plan, full) - prefill_cost(routing, device_plan, full) == pytest.approx(204.8 + 512)


def test_events_from_a_worker_without_tiers_decode_as_first_tier_blocks() -> None:
    import msgspec

    from shared.schemas.kv_events import KvEventWithoutTokens
    from tests.unit.kv_schema_history import FirstBlockStored

    wire = msgspec.msgpack.encode(FirstBlockStored(block_hashes=CHAIN[:1], parent_block_hash=None,
                                                   token_ids=PROMPT[:BLOCK], block_size=BLOCK, chain_hashes=CHAIN[:1]))
    assert msgspec.msgpack.decode(wire, type=kv_events.KvEvent).tier == "device"
    assert msgspec.msgpack.decode(wire, type=KvEventWithoutTokens).tier == "device"
    moved = msgspec.msgpack.encode(kv_events.BlocksMoved(block_hashes=CHAIN[:1], tier="host"))
    assert msgspec.msgpack.decode(moved, type=KvEventWithoutTokens) == kv_events.BlocksMoved(block_hashes=CHAIN[:1],
                                                                                             tier="host")
