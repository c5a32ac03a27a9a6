"""Cold victims first and bounded-load affinity, on plain data: where a prompt that must evict
goes, and when a tenant may leave the workers holding its prefix."""

from __future__ import annotations

from functools import partial

import pytest

from services.router.config import RoutingConfig
from services.router.routing import RoutePlan, RouteRequest, WorkerView, decide
from services.router.routing.cost import eviction_cost
from services.router.routing.recency import CacheRecency, victim_values
from tests.unit.worker_views import worker_view

ROUTING = RoutingConfig(cold_victims=True)  # off by default; these tests are about it
PREFIX = 1024
PROMPT = PREFIX + 64


worker = partial(worker_view, max_num_seqs=64, max_model_len=4096, kv_capacity_tokens=2560,
                 reported_free_kv_tokens=0)


def plan_of(workers: list[WorkerView], route: RouteRequest) -> RoutePlan:
    decision = decide(workers, route, ROUTING)
    assert isinstance(decision, RoutePlan), decision
    return decision


# ---- recency --------------------------------------------------------------------------------


def test_the_victim_is_the_least_recently_used_prefix_still_held() -> None:
    recency = CacheRecency()
    recency.touch("a", 1, now=10.0)
    recency.touch("a", 2, now=20.0)
    recency.touch("a", 1, now=30.0)  # 1 used again: 2 is now the oldest
    assert recency.victim_age("a", lambda key: True, now=35.0) == pytest.approx(15.0)
    # 2 was evicted (the index no longer has it): the victim is 1, and 2 is forgotten
    assert recency.victim_age("a", lambda key: key != 2, now=35.0) == pytest.approx(5.0)
    assert recency.victim_age("a", lambda key: True, now=35.0) == pytest.approx(5.0)
    assert recency.victim_age("b", lambda key: True, now=35.0) is None
    recency.forget("a")
    assert recency.victim_age("a", lambda key: True, now=35.0) is None


def test_tracking_is_bounded_per_worker() -> None:
    recency = CacheRecency(max_tracked=3)
    for key in range(10):
        recency.touch("a", key, now=float(key))
    assert recency.victim_age("a", lambda key: True, now=10.0) == pytest.approx(3.0)  # 7, 8, 9 kept


def test_victim_values_are_ratios_of_ages() -> None:
    values = victim_values({"hot": 1.0, "cold": 10.0, "unknown": None})
    assert values == {"hot": 1.0, "cold": pytest.approx(0.1), "unknown": 1.0}
    assert victim_values({"a": None}) == {"a": 1.0}
    assert eviction_cost(ROUTING, 1000, free_tokens=0, victim_value=0.1) == pytest.approx(
        0.1 * eviction_cost(ROUTING, 1000, free_tokens=0))


def test_a_cold_prompt_on_full_caches_goes_where_the_coldest_prefix_is() -> None:
    workers = [worker("a"), worker("b"), worker("c")]
    route = RouteRequest(model="m", prompt_tokens=PROMPT, total_tokens=PROMPT + 16,
                         victim_age_s={"a": 0.5, "b": 60.0, "c": 2.0})
    assert plan_of(workers, route).worker_id == "b"


def test_with_free_room_the_victims_do_not_matter() -> None:
    workers = [worker("a", reported_free_kv_tokens=2560), worker("b", reported_free_kv_tokens=2560)]
    young_b = RouteRequest(model="m", prompt_tokens=PROMPT, total_tokens=PROMPT + 16, victim_age_s={"a": 60.0, "b": 0.1})
    young_a = RouteRequest(model="m", prompt_tokens=PROMPT, total_tokens=PROMPT + 16, victim_age_s={"a": 0.1, "b": 60.0})
    assert plan_of(workers, young_b).worker_id == plan_of(workers, young_a).worker_id


# ---- bounded-load affinity -------------------------------------------------------------------


def tenant_request(holders: dict[str, int]) -> RouteRequest:
    return RouteRequest(model="m", prompt_tokens=PROMPT, total_tokens=PROMPT + 16, cached_tokens=holders,
                        held_tokens=holders, victim_age_s={"holder": 1.0, "b": 1000.0, "c": 1.0})


def test_a_tenant_stays_on_its_holder_while_its_load_is_within_the_bound() -> None:
    """Per request, the non-holder b looks cheaper (1.4 prompts less queued, a cold victim to
    evict, a cheap pull), but the holder's load is within the bound: the tenant stays."""
    workers = [worker("holder", reported_prefill_tokens=int(3.4 * PROMPT), reported_load=3),
               worker("b", reported_prefill_tokens=2 * PROMPT, reported_load=2),
               worker("c", reported_prefill_tokens=2 * PROMPT, reported_load=2)]
    route = tenant_request({"holder": PREFIX})
    candidates_cost = {view.worker_id: cost for view, cost in _single_costs(workers, route).items()}
    assert candidates_cost["b"] < candidates_cost["holder"]  # what greedy cost alone would pick
    assert plan_of(workers, route).worker_id == "holder"


def _single_costs(workers: list[WorkerView], route: RouteRequest) -> dict[WorkerView, float]:
    from services.router.routing.candidates import Candidates
    from services.router.routing.eligibility import Eligible, eligible

    allowed = eligible(workers, route, ROUTING)
    assert isinstance(allowed, Eligible)
    candidates = Candidates(workers, route, ROUTING, allowed)
    return {view: candidates.single(view).cost for view in workers}


def test_past_the_bound_the_prefix_is_hot_and_copied() -> None:
    workers = [worker("holder", reported_prefill_tokens=6 * PROMPT, reported_load=6),
               worker("b"), worker("c")]
    plan = plan_of(workers, tenant_request({"holder": PREFIX}))
    assert plan.worker_id != "holder" and plan.prompt is not None and plan.prompt.holder_id == "holder"


def test_a_short_shared_prefix_binds_nobody() -> None:
    """A prefix under half the prompt (a shared system prompt): plain costs decide."""
    workers = [worker("holder", reported_prefill_tokens=3 * PROMPT, reported_load=2), worker("b")]
    route = RouteRequest(model="m", prompt_tokens=PROMPT, total_tokens=PROMPT + 16, cached_tokens={"holder": 256},
                         held_tokens={"holder": 256})
    assert plan_of(workers, route).worker_id == "b"


def test_a_worker_with_room_to_spare_is_not_bound_by_affinity() -> None:
    """Copying the prefix onto a worker with free room evicts nothing: plain costs decide."""
    workers = [worker("holder", reported_prefill_tokens=int(3.4 * PROMPT), reported_load=3),
               worker("b", reported_prefill_tokens=0, reported_load=2, reported_free_kv_tokens=2560),
               worker("c", reported_prefill_tokens=2 * PROMPT, reported_load=2)]
    plan = plan_of(workers, tenant_request({"holder": PREFIX}))
    assert plan.worker_id == "b" and plan.prompt is not None and plan.prompt.holder_id == "holder"
