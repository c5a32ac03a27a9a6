"""Plans on plain data: what the routing pipeline answers once a policy selected its workers.
The chosen workers, the prompt's KV plan (held, pulled from a holder, computed), the decode
part and how its KV moves (pull, push, or none for a one-token request), and the cost."""

from __future__ import annotations

from functools import partial

import msgspec
import pytest

from services.router.config import RoutingConfig
from services.router.routing import RoutePlan, RouteRequest, Selection, WorkerView, build_plan, decide
from services.router.routing.candidates import Candidates
from services.router.routing.eligibility import Eligible, eligible
from shared.compat import KvLayout
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


def test_unlike_block_sizes_pull_and_unlike_parallel_degrees_may_push() -> None:
    tp2 = KvLayout(model="m", dtype="bfloat16", block_size=16, num_layers=2, num_kv_heads=4, head_size=8, engine="e",
                   tensor_parallel=2)
    for decode_size, transfer in ((16, "push"), (32, "pull")):
        workers = [worker("p", role=PREFILL, block_size=16, kv_layout=tp2),
                   worker("d", role=DECODE, block_size=decode_size,
                          kv_layout=msgspec.structs.replace(tp2, tensor_parallel=1, block_size=decode_size))]
        plan = build_plan(Selection("pair", workers[1], prefill=workers[0]),
                          candidates(workers, request(), RoutingConfig(pd_transfer="push")))
        assert plan.transfer == transfer


def test_without_a_mapping_the_request_is_served_whole_and_the_note_names_the_field() -> None:
    layout = KvLayout(model="m", dtype="bfloat16", block_size=16, num_layers=2, num_kv_heads=4, head_size=8, engine="e")
    other = msgspec.structs.replace(layout, head_size=16)
    workers = [worker("p", role=PREFILL, kv_layout=layout, compat_hash=layout.compat_hash()),
               worker("d", role=DECODE, kv_layout=other, compat_hash=other.compat_hash())]
    plan = decide(workers, request(), RoutingConfig())
    assert isinstance(plan, RoutePlan) and (plan.flow, plan.reason) == ("single", "compat_hash_mismatch")
    assert plan.note == "p -> d: head_size: 8 != 16"
