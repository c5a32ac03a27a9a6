"""Any worker may prefill for any other (`RoutingConfig.prefill_from` "any"): on plain views,
the router disaggregates a request only where the cost model says a pair wins, and says why."""

from __future__ import annotations

from functools import partial

import pytest

from services.router.config import RoutingConfig
from services.router.routing import RoutePlan, RouteRequest, decide
from shared.schemas import WorkerRole
from tests.unit.worker_views import worker_view

ANY = RoutingConfig(prefill_from="any", itl_weight=1.0)
worker = partial(worker_view, role=WorkerRole.BOTH, max_model_len=4096)


def route(workers, routing: RoutingConfig = ANY, prompt_tokens: int = 1000) -> RoutePlan:
    plan = decide(workers, RouteRequest(model="m", prompt_tokens=prompt_tokens, total_tokens=prompt_tokens + 64),
                  routing)
    assert isinstance(plan, RoutePlan)
    return plan


def test_when_nothing_decodes_anywhere_a_request_is_served_whole() -> None:
    """Arrivals spread out: no decode to protect, and a pair would pay the hand-off."""
    plan = route([worker("a"), worker("b")])
    assert (plan.flow, plan.reason) == ("single", "single_cheaper")


def test_a_prompt_goes_where_little_decodes_and_its_decode_where_little_is_queued() -> None:
    """Arrivals bunched: a decodes four requests, b is prefilling two prompts. Computing the
    prompt on a would stall a's four decodes; decoding on b would wait for b's queue."""
    workers = [worker("a", reported_load=4), worker("b", reported_load=2, reported_prefill_tokens=2000)]
    plan = route(workers)
    assert (plan.flow, plan.reason, plan.prefill_worker_id, plan.worker_id) == ("disaggregated", "pair", "b", "a")
    assert plan.transfer == "pull"


def test_a_long_enough_queue_sends_the_prompt_to_the_decoding_worker_after_all() -> None:
    """TTFT wins over the decodes' latency once the other worker's queue is long enough."""
    workers = [worker("a", reported_load=1), worker("b", reported_load=3, reported_prefill_tokens=9000)]
    plan = route(workers)
    assert plan.flow == "single" and plan.worker_id == "a"


def test_without_the_interference_terms_ttft_alone_decides_where_the_prompt_is_computed() -> None:
    workers = [worker("a", reported_load=4), worker("b", reported_load=2, reported_prefill_tokens=2000)]
    plan = route(workers, RoutingConfig(prefill_from="any"))
    assert plan.computing_worker_id == "a"  # a's empty queue: its four decodes are not priced


def test_roles_still_pin_pools_and_a_worker_never_takes_both_parts() -> None:
    """With prefill_from "prefill" both workers only serve whole; with "any" a prefill worker
    still prefills, and the pair's two parts are on two workers."""
    workers = [worker("a", reported_load=4), worker("b", reported_load=2, reported_prefill_tokens=2000)]
    assert route(workers, RoutingConfig(itl_weight=1.0)).flow == "single"
    lone = [worker("p", role=WorkerRole.PREFILL), worker("only", reported_load=6)]
    plan = route(lone)
    assert (plan.flow, plan.prefill_worker_id, plan.worker_id) == ("disaggregated", "p", "only")


@pytest.mark.parametrize("itl_weight", [0.5, 1.0, 2.0])
def test_the_pair_costs_its_hand_off(itl_weight: float) -> None:
    routing = RoutingConfig(prefill_from="any", itl_weight=itl_weight)
    workers = [worker("a", reported_load=4), worker("b", reported_load=2, reported_prefill_tokens=2000)]
    plan = route(workers, routing)
    single = route([workers[1]], routing)
    if plan.flow == "disaggregated":  # the pair's cost includes the pull of the whole prompt
        assert plan.cost >= routing.pull_fixed_tokens + routing.transfer_weight * 1000
    assert single.flow == "single"


def test_a_lone_worker_says_there_is_none_to_split_with() -> None:
    plan = route([worker("a", reported_load=4)])
    assert (plan.flow, plan.reason) == ("single", "one_worker")
    mismatched = [worker("a", reported_load=4), worker("b", compat_hash="other")]
    plan = route(mismatched)  # two workers, but no KV maps between them: the reason says so
    assert (plan.flow, plan.reason, plan.worker_id) == ("single", "compat_hash_mismatch", "b")


def test_under_load_the_worker_with_fewest_requests_is_kept_free_of_decodes() -> None:
    """a decodes one request, b none: b is where the next prompts go (no decodes to stall),
    so this request's prompt is computed there and its decode joins a's; with nothing in
    flight, or a tie, the request is served whole."""
    plan = route([worker("a", reported_load=1), worker("b")])
    assert (plan.flow, plan.prefill_worker_id, plan.worker_id) == ("disaggregated", "b", "a")
    assert route([worker("a", reported_load=1), worker("b", reported_load=1)]).flow == "single"
    without = route([worker("a", reported_load=1), worker("b")], RoutingConfig(prefill_from="any"))
    assert (without.flow, without.worker_id) == ("single", "b")  # no interference terms: the idle worker


def test_a_prompt_computed_for_another_worker_has_no_decode_to_stall() -> None:
    """The request just split: its prompt is computed on x (a pair prefill part there, 1,000
    tokens queued) and it will decode on y. The next request must not have its prompt
    computed on y, beside that decode: x has no decode to stall, and the prompt queued there
    delays only the next request's first token."""
    x = worker("x", reported_load=None, in_flight=1, prefill_parts=1, outstanding_prefill_tokens=1000)
    y = worker("y", reported_load=None, in_flight=1)
    assert (x.decoding_load, y.decoding_load) == (0, 1)
    plan = route([x, y])
    assert plan.computing_worker_id == "x", plan
    # counted as decoding on x (the ledger before), x looked as costly to stall as y
    as_decoding = worker("x", reported_load=None, in_flight=1, outstanding_prefill_tokens=1000)
    assert route([as_decoding, y]).computing_worker_id == "y"


def test_a_whole_request_waits_for_no_queued_prompt_between_its_tokens() -> None:
    """Prompts queued on a worker are computed before a whole request's own, so they cost its
    first token (the queue term) and none of its decode steps; a pair's decode part there
    waits for them between its tokens."""
    from services.router.routing.cost import decode_cost

    queued = worker("q", reported_load=2, reported_prefill_tokens=2000)
    assert decode_cost(ANY, queued) - decode_cost(ANY, queued, whole=True) == 2000.0
    assert decode_cost(RoutingConfig(prefill_from="any"), queued) == decode_cost(ANY, queued, whole=True)


def test_the_exposure_grows_with_the_requests_in_flight() -> None:
    from services.router.routing.cost import decode_exposure

    assert decode_exposure(ANY, 1000, 0) == 0.0
    assert decode_exposure(ANY, 1000, 3) == 3 * decode_exposure(ANY, 1000, 1) == 3000.0


def test_stalls_within_the_decodes_budget_cost_nothing() -> None:
    """`itl_budget_tokens`: what a decoding request absorbs before its time per output token
    reaches the SLO. Within it, the bunched case above is served whole (the hand-off buys
    nothing); where a prompt overruns it, the pair wins again."""
    from services.router.routing.cost import itl_excess

    budgeted = RoutingConfig(prefill_from="any", itl_weight=1.0, itl_budget_tokens=5000)
    workers = [worker("a", reported_load=4), worker("b", reported_load=2, reported_prefill_tokens=2000)]
    assert route(workers, budgeted).flow == "single"
    tight = RoutingConfig(prefill_from="any", itl_weight=1.0, itl_budget_tokens=100)
    plan = route(workers, tight)
    assert (plan.flow, plan.prefill_worker_id, plan.worker_id) == ("disaggregated", "b", "a")
    assert itl_excess(budgeted, 0, 1000) == 0.0
    assert itl_excess(budgeted, 4500, 1000) == 500.0  # the queue ahead uses most of the budget
    assert itl_excess(budgeted, 6000, 1000) == 1000.0
    assert itl_excess(ANY, 6000, 1000) == 1000.0  # no budget: every token


def test_the_budget_comes_from_the_itl_slo_and_the_engine_timings() -> None:
    from services.router.routing.calibration import EngineTiming, slo_itl_budget_tokens

    timing = EngineTiming(prefill_ms_per_token=0.05, step_overhead_ms=1.0, decode_base_ms=8.0,
                          decode_ms_per_seq=0.1, max_num_seqs=64)
    # a full step takes 15.4 ms: 39.6 ms of slack per token over 64 tokens, at 0.05 ms per prompt token
    assert slo_itl_budget_tokens(55, 64, timing) == 50688
    # a sim sped up 10x: its steps and prompt tokens take a tenth of the wall time each
    assert slo_itl_budget_tokens(55, 64, EngineTiming(0.5, 1.0, 8.0, 0.1, 64, speedup=10)) == round(53.46 * 64 / 0.05)
    assert slo_itl_budget_tokens(10, 64, timing) == 0  # a full batch alone misses the SLO
    with pytest.raises(ValueError):
        slo_itl_budget_tokens(0, 64, timing)


def test_within_the_budget_every_request_goes_where_whole_serving_sends_it() -> None:
    """The sim sweep's fleets (8 workers, up to 6 requests each and 4,000 prompt tokens queued,
    prompts of 1,000 tokens with a prefix key): with the sim's budget no stall reaches the ITL
    SLO, so `prefill_from` "any" picks exactly the worker that plain whole serving picks, in
    every one of 500 seeded fleets; with every stall priced (budget 0) it does not."""
    import random

    rng = random.Random(54)
    whole = RoutingConfig()
    budgeted = RoutingConfig(prefill_from="any", itl_weight=1.136, itl_budget_tokens=50688)
    unbudgeted = RoutingConfig(prefill_from="any", itl_weight=1.136)
    differ = 0
    for case in range(500):
        fleet = [worker(f"w{k}", max_num_seqs=64, reported_load=rng.randint(0, 6),
                        reported_prefill_tokens=rng.choice([0, 0, 1000, 2000, 4000])) for k in range(8)]

        def routed(routing: RoutingConfig) -> tuple[str, str | None]:
            request = RouteRequest(model="m", prompt_tokens=1000, total_tokens=1064, prefix_key=case, block_tokens=16)
            plan = decide(fleet, request, routing)
            assert isinstance(plan, RoutePlan)
            return plan.worker_id, plan.prefill_worker_id

        assert routed(budgeted) == routed(whole)
        differ += routed(unbudgeted) != routed(whole)
    assert differ > 100
