"""The cost model's terms on plain data: pull cost, eviction cost, affinity with bounded
imbalance, hot-prefix replication, the plain baseline without pulls, and the pinned policy."""

from __future__ import annotations

import dataclasses
from functools import partial

import msgspec
import pytest

from services.router.config import RoutingConfig
from services.router.routing import RoutePlan, RouteRequest, WorkerView, decide
from services.router.routing.config import ALWAYS_SPLIT
from services.router.routing.cost import PrefillPlan, affinity_margin, eviction_cost, prefill_cost, pull_cost
from services.router.routing.placement.shares import (
    copies_needed,
    homes_overflow,
    minor_tenant,
    prefix_is_hot,
    share_cap,
)
from services.router.routing.placement.snapshot import PrefixPlacement
from shared.schemas import LoadSnapshot, WorkerStatus
from tests.unit.worker_views import worker_view

DEFAULT = RoutingConfig()
ROUTING = RoutingConfig(cold_victims=True)
PREFIX = 1536  # a tenant's shared prefix
PROMPT = PREFIX + 64


worker = partial(worker_view, max_num_seqs=64, max_model_len=4096, kv_capacity_tokens=4400,
                 reported_free_kv_tokens=0)


def tenant_request(holders: dict[str, int], **fields) -> RouteRequest:
    return RouteRequest(model="m", prompt_tokens=PROMPT, total_tokens=PROMPT + 16, cached_tokens=holders,
                        held_tokens=holders, **fields)


def plan_of(workers: list[WorkerView], route: RouteRequest, routing: RoutingConfig = ROUTING) -> RoutePlan:
    decision = decide(workers, route, routing)
    assert isinstance(decision, RoutePlan), decision
    return decision


# ---- the terms ------------------------------------------------------------------------------


def test_a_pull_costs_a_fixed_hand_off_plus_its_tokens() -> None:
    routing = RoutingConfig(pull_fixed_tokens=40, transfer_weight=0.25)
    assert pull_cost(routing, 0) == 0
    assert pull_cost(routing, 1000) == pytest.approx(40 + 250)


def test_eviction_costs_only_what_does_not_fit_in_free_room() -> None:
    routing = RoutingConfig(eviction_weight=0.5)
    assert eviction_cost(routing, 1600, free_tokens=4000) == 0
    assert eviction_cost(routing, 1600, free_tokens=600) == pytest.approx(0.5 * 1000)
    assert eviction_cost(routing, 1600, free_tokens=0) == pytest.approx(800)
    assert eviction_cost(routing, 1600, free_tokens=None) == 0  # unknown room: counted as room


def test_free_room_is_predicted_from_the_report_less_what_was_routed_since() -> None:
    view = worker("a", reported_free_kv_tokens=2000, outstanding_prefill_tokens=1700, outstanding_prefill_at_report=200)
    assert view.free_kv_tokens == 500
    assert worker("a", reported_free_kv_tokens=None, kv_capacity_tokens=4400).free_kv_tokens == 4400
    assert worker("a", reported_free_kv_tokens=None, kv_capacity_tokens=0).free_kv_tokens is None


def test_the_worker_pool_reads_free_room_from_a_load_snapshot() -> None:
    from services.router.fleet.worker_state import free_kv_tokens

    snapshot = LoadSnapshot(worker_id="a", seq=1, ts=0.0, running=0, waiting=0, kv_total_blocks=100,
                            kv_used_blocks=10, kv_cached_blocks=70, prompt_tokens_total=0, cached_tokens_total=0,
                            generated_tokens_total=0, pending_prefill_tokens=0)
    assert free_kv_tokens(snapshot, block_size=16) == 30 * 16


def test_a_pull_onto_a_full_cache_pays_for_what_it_evicts() -> None:
    plan = PrefillPlan("b", cached_tokens=0, pulled_tokens=PREFIX, holder_id="a", uncached_tokens=64)
    full, roomy = worker("b", reported_free_kv_tokens=0), worker("b", reported_free_kv_tokens=8000)
    assert prefill_cost(ROUTING, plan, full) - prefill_cost(ROUTING, plan, roomy) == pytest.approx(
        ROUTING.eviction_weight * PROMPT)


# ---- affinity with bounded imbalance --------------------------------------------------------


def test_a_holder_keeps_its_tenant_while_its_queue_is_within_the_margin() -> None:
    """The holder has one whole other prompt queued (what made the old model spread); the
    others are idle with full caches: the tenant stays where its prefix is."""
    workers = [worker("holder", reported_prefill_tokens=PROMPT), worker("b"), worker("c")]
    plan = plan_of(workers, tenant_request({"holder": PREFIX}))
    assert plan.worker_id == "holder" and plan.prompt is not None and plan.prompt.holder_id is None


def test_past_the_margin_the_tenant_spreads_and_pulls() -> None:
    margin = affinity_margin(ROUTING, PREFIX, free_tokens=0) + ROUTING.pull_fixed_tokens
    queued = int(margin / ROUTING.queue_weight) + 2 * PROMPT
    workers = [worker("holder", reported_prefill_tokens=queued), worker("b")]
    plan = plan_of(workers, tenant_request({"holder": PREFIX}))
    assert plan.worker_id == "b" and plan.prompt is not None and plan.prompt.holder_id == "holder"


def test_the_margin_grows_with_the_value_of_the_hit() -> None:
    assert affinity_margin(ROUTING, 2048, 0) > affinity_margin(ROUTING, 256, 0) > 0
    # a short prefix tolerates little queue: 256 cached tokens lose to an idle worker early
    short = RouteRequest(model="m", prompt_tokens=320, total_tokens=336, cached_tokens={"holder": 256},
                         held_tokens={"holder": 256})
    workers = [worker("holder", reported_prefill_tokens=1600), worker("b")]
    assert plan_of(workers, short).worker_id == "b"
    assert plan_of(workers, tenant_request({"holder": PREFIX})).worker_id == "holder"


# ---- replication of a hot prefix ------------------------------------------------------------


def test_a_prefix_is_hot_when_every_holder_carries_well_over_the_mean_load() -> None:
    # mean load 6: the bound is max(1.5 x 6, 6 + 2) = 9
    busy = [worker("a", reported_load=12), worker("b", reported_load=2), worker("c", reported_load=10),
            worker("d", reported_load=0)]
    assert prefix_is_hot(ROUTING, busy, {"a": PREFIX}, PROMPT)
    assert not prefix_is_hot(ROUTING, busy, {"a": PREFIX, "b": PREFIX}, PROMPT)  # b can carry more
    assert prefix_is_hot(ROUTING, busy, {"a": PREFIX, "c": PREFIX, "b": 256}, PROMPT)  # b holds less
    assert not prefix_is_hot(ROUTING, busy, {}, PROMPT)
    assert not prefix_is_hot(msgspec.structs.replace(ROUTING, hot_load_factor=0), busy, {"a": PREFIX}, PROMPT)
    # at small loads, one request over the mean is not hot: the bound is at least mean + 2
    light = [worker("a", reported_load=2), worker("b", reported_load=0), worker("c", reported_load=0)]
    assert not prefix_is_hot(ROUTING, light, {"a": PREFIX}, PROMPT)


def test_a_hot_prefix_is_replicated_onto_a_second_worker() -> None:
    """The holder carries a popular tenant: 12 requests against the others' 2, with a modest
    prefill queue; b's cache holds only a prefix not asked for in a long while. Replication
    lets go of affinity, so b pulls the prefix and becomes its second holder; without it
    (or where b's victim is as recent as the holder's) the tenant stays."""
    holder = worker("holder", reported_load=12, reported_prefill_tokens=300)
    workers = [holder, worker("b", reported_load=2), worker("c", reported_load=2)]
    cold_b = {"holder": 1.0, "b": 500.0, "c": 1.0}
    plan = plan_of(workers, tenant_request({"holder": PREFIX}, victim_age_s=cold_b))
    assert plan.worker_id == "b" and plan.prompt is not None and plan.prompt.holder_id == "holder"
    no_replication = msgspec.structs.replace(ROUTING, hot_load_factor=0)
    assert plan_of(workers, tenant_request({"holder": PREFIX}, victim_age_s=cold_b),
                   no_replication).worker_id == "holder"
    all_warm = {"holder": 1.0, "b": 1.0, "c": 1.0}
    assert plan_of(workers, tenant_request({"holder": PREFIX}, victim_age_s=all_warm)).worker_id == "holder"
    # by default victims are not weighed: the copy goes where it evicts nothing
    roomy_c = [holder, worker("b", reported_load=2), worker("c", reported_load=2, reported_free_kv_tokens=4400)]
    plan = plan_of(roomy_c, tenant_request({"holder": PREFIX}), DEFAULT)
    assert plan.worker_id == "c" and plan.prompt is not None and plan.prompt.holder_id == "holder"
    assert plan_of(workers, tenant_request({"holder": PREFIX}), DEFAULT).worker_id == "holder"


def test_copies_needed_splits_a_share_over_workers_each_carrying_at_most_the_cap() -> None:
    # 4 workers, slack 0.2: each carries at most 0.3 of the requests
    assert copies_needed(0.26, 4, 0.2) == 1
    assert copies_needed(0.3, 4, 0.2) == 1
    assert copies_needed(0.31, 4, 0.2) == 2
    assert copies_needed(0.95, 4, 0.2) == 4
    assert copies_needed(1.0, 2, 0.0) == 2
    assert copies_needed(0.0, 4, 0.2) == 1
    assert copies_needed(0.5, 0, 0.2) == 0


def test_a_busy_holder_keeps_a_tenant_whose_share_it_can_carry() -> None:
    """A queue is a moment's figure: the holder is busy, but the prefix draws 0.26 of the
    requests, which one worker carries (the cap is 0.3 of 4 workers), so it queues there.
    Past the cap it is copied."""
    busy = [worker("a", reported_load=12), worker("b", reported_load=2), worker("c", reported_load=10),
            worker("d", reported_load=0)]
    assert not prefix_is_hot(ROUTING, busy, {"a": PREFIX}, PROMPT, 0.26)
    assert prefix_is_hot(ROUTING, busy, {"a": PREFIX}, PROMPT, 0.32)
    # two holders carry up to 0.6
    assert not prefix_is_hot(ROUTING, busy, {"a": PREFIX, "c": PREFIX}, PROMPT, 0.5)
    assert prefix_is_hot(ROUTING, busy, {"a": PREFIX, "c": PREFIX}, PROMPT, 0.7)
    # unknown share, or the share rule off: the load alone decides, as before
    assert prefix_is_hot(ROUTING, busy, {"a": PREFIX}, PROMPT, None)
    by_load = msgspec.structs.replace(ROUTING, replica_share_slack=None)
    assert prefix_is_hot(by_load, busy, {"a": PREFIX}, PROMPT, 0.26)
    # never hot when the holder is not busy, whatever the share
    assert not prefix_is_hot(ROUTING, busy, {"b": PREFIX}, PROMPT, 0.9)
    # in a decision: the tenant stays on its busy holder, or is copied once it needs two
    # (every cache full, the holder's queue long enough that a copy would be cheaper)
    workers = [worker("holder", reported_load=12, reported_prefill_tokens=4000), worker("b", reported_load=2),
               worker("c", reported_load=2)]
    assert plan_of(workers, tenant_request({"holder": PREFIX}, placement=PrefixPlacement(share=0.3)), DEFAULT).worker_id == "holder"
    copied = plan_of(workers, tenant_request({"holder": PREFIX}, placement=PrefixPlacement(share=0.6)), DEFAULT)
    assert copied.worker_id != "holder" and copied.prompt is not None and copied.prompt.holder_id == "holder"


def test_a_minor_tenant_is_a_small_share_of_an_overcommitted_worker() -> None:
    # 4 workers, slack 0.2: the cap is 0.3
    assert minor_tenant(0.07, 0.4, 4, 0.2)
    assert not minor_tenant(0.07, 0.29, 4, 0.2)  # within the cap: nobody need leave
    assert not minor_tenant(0.26, 0.4, 4, 0.2)  # the major tenant
    assert not minor_tenant(0.17, 0.38, 4, 0.2)  # under half of it, but a large tenant still
    assert minor_tenant(0.1, 0.6, 4, 0.2)


def test_the_share_cap_and_a_home_whose_prefixes_overflow_its_kv() -> None:
    assert share_cap(4, 0.2) == pytest.approx(0.3) and share_cap(2, 0.0) == pytest.approx(0.5)
    assert homes_overflow(worker("a"), 4401)  # the test workers hold 4400 tokens
    assert not homes_overflow(worker("a"), 4400)
    assert not homes_overflow(worker("a"), None)  # unknown homed tokens
    assert not homes_overflow(worker("a", kv_capacity_tokens=0), 10_000)  # unknown pool


# ---- the plain baseline and the pinned policy -----------------------------------------------


def test_without_prefix_pulls_a_worker_computes_what_it_does_not_hold() -> None:
    plain = RoutingConfig(policy="round-robin", prefix_pull=False)
    plan = plan_of([worker("a", last_routed=1), worker("b", last_routed=0)], tenant_request({"a": PREFIX}), plain)
    assert plan.worker_id == "b" and plan.prompt is not None
    assert (plan.prompt.holder_id, plan.prompt.pulled_tokens, plan.prompt.uncached_tokens) == (None, 0, PROMPT)


def test_the_pinned_policy_serves_on_the_hinted_worker_or_falls_back_to_kv_aware() -> None:
    pinned = RoutingConfig(policy="pinned")
    workers = [worker("holder"), worker("b"), worker("gone", status=WorkerStatus.DRAINING)]
    plan = plan_of(workers, tenant_request({"holder": PREFIX}, route_hint="b"), pinned)
    assert (plan.worker_id, plan.reason) == ("b", "pinned")
    for hint in ("gone", "nobody", None):  # not eligible, unknown, absent: kv-aware decides
        plan = plan_of(workers, tenant_request({"holder": PREFIX}, route_hint=hint), pinned)
        assert plan.worker_id == "holder" and plan.reason != "pinned"
    # other policies ignore the hint
    assert plan_of(workers, tenant_request({"holder": PREFIX}, route_hint="b")).worker_id == "holder"


def test_a_pinned_pair_where_its_prefill_worker_may_compute_for_another() -> None:
    any_pinned = RoutingConfig(policy="pinned", prefill_from="any", kv_aware=ALWAYS_SPLIT)
    workers = [worker("a"), worker("b"), worker("other", compat_hash="h2")]
    plan = plan_of(workers, tenant_request({}, route_hint="a>b"), any_pinned)
    assert (plan.flow, plan.reason, plan.prefill_worker_id, plan.worker_id) == ("disaggregated", "pinned", "a", "b")
    # a both worker prefills for another only with prefill_from "any"; never both parts; one hash
    for hint, routing in (("a>b", RoutingConfig(policy="pinned")), ("a>a", any_pinned), ("a>other", any_pinned)):
        assert plan_of(workers, tenant_request({}, route_hint=hint), routing).reason != "pinned"


# ---- calibration ----------------------------------------------------------------------------


def test_weights_are_times_over_the_time_of_one_prompt_token() -> None:
    from services.router.routing.calibration import EngineTiming, TransferTiming, calibrated_weights

    engine = EngineTiming(prefill_ms_per_token=0.05, step_overhead_ms=1.0, decode_base_ms=8.0,
                          decode_ms_per_seq=0.1, max_num_seqs=64)
    # 128 KiB per token at 10 GB/s: 0.0131 ms, a quarter of a prompt token's compute
    transfer = TransferTiming(kv_bytes_per_token=131072, gbps=10.0, round_trip_ms=2.0)
    weights = calibrated_weights(engine, transfer)
    assert weights["transfer_weight"] == pytest.approx(0.2621, abs=1e-4)
    assert weights["pull_fixed_tokens"] == pytest.approx(40.0)
    assert weights["decode_weight"] == pytest.approx(2 * (1 + 8 + 6.4) / 0.05)
    assert weights["request_overhead_tokens"] == pytest.approx((1 + 8) / 0.05)
    # a sim slowed to a quarter: engine times stretch, the network does not
    slow = calibrated_weights(EngineTiming(0.05, 1.0, 8.0, 0.1, 64, speedup=0.25), transfer)
    assert slow["pull_fixed_tokens"] == pytest.approx(10.0)
    assert slow["transfer_weight"] == pytest.approx(weights["transfer_weight"] / 4, abs=1e-4)
    assert slow["decode_weight"] == weights["decode_weight"]
    assert slow["request_overhead_tokens"] == weights["request_overhead_tokens"]
    RoutingConfig(**weights).validate()  # every figure is a valid router setting (an unknown name: TypeError)
    with pytest.raises(ValueError):
        EngineTiming(0.0, 1.0, 8.0, 0.1, 64)


def test_the_interference_weight_is_the_slos_exchange_rate_per_output_token() -> None:
    from services.router.routing.calibration import slo_itl_weight

    assert slo_itl_weight(4000, 55, 64) == pytest.approx(4000 / 55 / 64, abs=1e-3)  # 1.136
    # a tighter decode SLO, or shorter answers (one spike is more of each), weigh more
    assert slo_itl_weight(4000, 25, 64) > slo_itl_weight(4000, 55, 64) < slo_itl_weight(4000, 55, 16)
    RoutingConfig(itl_weight=slo_itl_weight(4000, 55, 64)).validate()
    with pytest.raises(ValueError):
        slo_itl_weight(4000, 0, 64)


# ---- a cold prompt's home -------------------------------------------------------------------


def test_a_cold_prompt_goes_to_its_prefixs_home_among_the_near_cheapest() -> None:
    from services.router.routing.placement.home import home_score

    workers = [worker(name, reported_load=load) for name, load in (("a", 1), ("b", 0), ("c", 1), ("d", 2))]
    homes = {}
    for key in range(40):
        plan = plan_of(workers, RouteRequest(model="m", prompt_tokens=PROMPT, total_tokens=PROMPT + 16,
                                             prefix_key=key))
        homes[key] = plan.worker_id
        assert plan.worker_id == max(workers, key=lambda view: home_score(key, view.worker_id)).worker_id
    assert len(set(homes.values())) == 4  # prefixes spread over the workers, each to one home
    again = [plan_of(workers, RouteRequest(model="m", prompt_tokens=PROMPT, total_tokens=PROMPT + 16,
                                           prefix_key=key)).worker_id for key in range(40)]
    assert again == list(homes.values())  # stable


def test_a_busy_home_is_skipped_and_a_warm_prompt_ignores_homes() -> None:
    from services.router.routing.placement.home import home_score

    key = 7
    home = max("abcd", key=lambda name: home_score(key, name))
    busy = [worker(name, reported_prefill_tokens=(4000 if name == home else 0)) for name in "abcd"]
    cold = RouteRequest(model="m", prompt_tokens=PROMPT, total_tokens=PROMPT + 16, prefix_key=key)
    assert plan_of(busy, cold).worker_id != home
    idle = [worker(name) for name in "abcd"]
    assert plan_of(idle, cold).worker_id == home
    other = next(name for name in "abcd" if name != home)
    warm = tenant_request({other: PREFIX}, prefix_key=key)
    assert plan_of(idle, warm).worker_id == other  # the holder, not the home
    off = msgspec.structs.replace(ROUTING, home_slack_tokens=0)
    assert plan_of(idle, cold, off).worker_id == "a"  # off: the least loaded, then the smallest id


def test_a_burst_of_distinct_cold_prompts_still_spreads_evenly() -> None:
    """Homes are bounded by load: a worker with more queued prefill than the mean is no home."""
    workers = {name: worker(name) for name in "ab"}
    picks = []
    for key in range(4):
        plan = plan_of(list(workers.values()), RouteRequest(model="m", prompt_tokens=300, total_tokens=316,
                                                            prefix_key=key * 7919))
        picks.append(plan.worker_id)
        view = workers[plan.worker_id]
        workers[plan.worker_id] = dataclasses.replace(
            view, outstanding_prefill_tokens=view.outstanding_prefill_tokens + 300, in_flight=view.in_flight + 1)
    assert sorted(picks.count(name) for name in "ab") == [2, 2]
