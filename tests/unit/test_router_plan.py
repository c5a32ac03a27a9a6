"""Plans on plain data: what the routing pipeline answers once a policy selected its workers.
The chosen workers, the prompt's KV plan (held, pulled from a holder, computed), the decode
part and how its KV moves (pull, push, or none for a one-token request), and the cost."""

from __future__ import annotations

from functools import partial

import pytest

from services.router.config import RoutingConfig
from services.router.routing import RoutePlan, RouteRequest, Selection, WorkerView, build_plan, decide
from services.router.routing.candidates import Candidates
from services.router.routing.eligibility import Eligible, eligible
from shared.schemas import WorkerRole
from tests.unit.worker_views import worker_view

PREFILL, DECODE, BOTH = WorkerRole.PREFILL, WorkerRole.DECODE, WorkerRole.BOTH


worker = partial(worker_view, kv_push=True)


def request(max_tokens: int = 100, **fields) -> RouteRequest:
    return RouteRequest(model="m", prompt_tokens=500, total_tokens=500 + max_tokens, **fields)


def candidates(workers: list[WorkerView], route: RouteRequest, routing: RoutingConfig = RoutingConfig()) -> Candidates:
    allowed = eligible(workers, route, routing)
    assert isinstance(allowed, Eligible)
    return Candidates(workers, route, routing, allowed)


PD = [worker("p", role=PREFILL), worker("d", role=DECODE)]


def test_a_single_plan_names_its_worker_and_its_prefix_pull() -> None:
    workers = [worker("a"), worker("holder", reported_load=7)]
    route = request(held_tokens={"holder": 448}, cached_tokens={"holder": 448})
    plan = build_plan(Selection("baseline", workers[0]), candidates(workers, route))
    assert (plan.flow, plan.worker_id, plan.computing_worker_id, plan.decode_worker_id) == ("single", "a", "a", None)
    assert plan.prefix_holder_id == "holder" and plan.transfer is None
    assert plan.prompt is not None and (plan.prompt.pulled_tokens, plan.prompt.uncached_tokens) == (448, 52)
    # prefill_weight x 52 + pull_fixed_tokens + transfer_weight x 448 (no queue, no decode load,
    # no eviction: the cache's free room is unknown)
    assert plan.cost == pytest.approx(52 + 32 + 44.8)


def test_a_pair_plan_has_a_decode_part_whose_kv_is_pulled_by_default() -> None:
    plan = build_plan(Selection("pair", PD[1], prefill=PD[0]), candidates(PD, request()))
    assert (plan.flow, plan.computing_worker_id, plan.decode_worker_id, plan.transfer) == \
        ("disaggregated", "p", "d", "pull")
    assert plan.cost == pytest.approx(500)


@pytest.mark.parametrize(("kv_push", "held", "transfer"), [
    ((True, True), {}, "push"),
    ((True, False), {}, "pull"),  # the decode worker's engine cannot receive pushes
    ((True, True), {"other": 448}, "pull"),  # the prefill worker pulls a cached prefix first
])
def test_push_where_the_pair_can(kv_push: tuple[bool, bool], held: dict[str, int], transfer: str) -> None:
    workers = [worker("p", role=PREFILL, kv_push=kv_push[0]), worker("d", role=DECODE, kv_push=kv_push[1]),
               worker("other", role=PREFILL, reported_load=8)]
    route = request(held_tokens=held)
    plan = build_plan(Selection("pair", workers[1], prefill=workers[0]),
                      candidates(workers, route, RoutingConfig(pd_transfer="push")))
    assert plan.transfer == transfer


def test_a_one_token_request_has_no_decode_part() -> None:
    plan = build_plan(Selection("pair", PD[1], prefill=PD[0]), candidates(PD, request(max_tokens=1)))
    assert (plan.flow, plan.prefill_worker_id, plan.decode_worker_id, plan.transfer) == ("disaggregated", "p", None, None)


def test_decide_answers_the_plan_of_the_selection() -> None:
    plan = decide(PD, request(), RoutingConfig(pd_transfer="push"))
    assert plan == RoutePlan("disaggregated", "pair", "d", prefill_worker_id="p")
    assert isinstance(plan, RoutePlan) and plan.transfer == "push" and plan.prompt is not None
    with pytest.raises(AssertionError):
        RoutePlan("single", "baseline", "a", transfer="pull")  # only a disaggregated plan moves KV to a decode part
