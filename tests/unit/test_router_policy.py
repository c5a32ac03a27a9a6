"""Routing policy on plain data: eligibility, least-loaded choice, predicted load, ties, the
prefill/decode pair of the disaggregated flow (load, compatibility hash, fallbacks), and the
cost model: prefix affinity, pulls, conditional disaggregation, admission, decode-first."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.router.config import RoutingConfig
from services.router.routing import (
    RoutePlan,
    RouteRefusal,
    RouteRequest,
    WorkerView,
    context_limit,
    decide,
    kv_transfer_mode,
)
from services.router.routing.config import ALWAYS_SPLIT, KvAwareConfig
from services.router.routing.cost import Holders, plan_prefill
from shared.config import ConfigError
from shared.schemas import WorkerRole, WorkerStatus
from tests.unit.worker_views import worker_view

PREFILL, DECODE, BOTH = WorkerRole.PREFILL, WorkerRole.DECODE, WorkerRole.BOTH


worker = worker_view


# Long enough that a prefill/decode hand-off pays off when nothing is cached.
REQUEST = RouteRequest(model="m", prompt_tokens=500, total_tokens=600)


def request(**fields) -> RouteRequest:
    return replace(REQUEST, **fields)


def chosen(workers: list[WorkerView], route: RouteRequest = REQUEST, routing: RoutingConfig = RoutingConfig()) -> str | None:
    decision = decide(workers, route, routing)
    assert not isinstance(decision, RouteRefusal), decision
    return None if decision is None else decision.worker_id


def single(reason: str, worker_id: str) -> RoutePlan:
    return RoutePlan("single", reason, worker_id)  # type: ignore[arg-type]


def pair(prefill: str, decode: str) -> RoutePlan:
    return RoutePlan("disaggregated", "pair", decode, prefill_worker_id=prefill)


# ---- eligibility and load ------------------------------------------------------------


def test_no_workers_means_no_choice() -> None:
    assert decide([], REQUEST) is None


def test_only_active_workers_of_the_model_with_a_serving_role_qualify() -> None:
    workers = [
        worker("draining", status=WorkerStatus.DRAINING),
        worker("prefill", role=PREFILL),
        worker("other-model", model="other"),
        worker("short-context", max_model_len=599),
    ]
    assert decide(workers, REQUEST) is None  # a prefill worker never serves whole requests
    assert chosen([*workers, worker("decode", role=DECODE)]) == "decode"


def test_least_loaded_relative_to_capacity() -> None:
    workers = [worker("a", reported_load=3), worker("b", reported_load=1), worker("c", reported_load=2)]
    assert chosen(workers) == "b"
    # 4 of 16 slots is lighter than 3 of 8
    assert chosen([worker("a", reported_load=3), worker("big", reported_load=4, max_num_seqs=16)]) == "big"


def test_predicted_load_adds_requests_routed_since_the_report() -> None:
    # reported 2 when we had 0 in flight; we have routed 3 since: 5
    assert worker("a", reported_load=2, in_flight=3, in_flight_at_report=0).predicted_load == 5
    # reported 4 counting our 3; 2 of ours finished since: 2
    assert worker("a", reported_load=4, in_flight=1, in_flight_at_report=3).predicted_load == 2
    # never below what we know is in flight
    assert worker("a", reported_load=0, in_flight=2, in_flight_at_report=2).predicted_load == 2
    assert worker("a", reported_load=None, in_flight=2).predicted_load == 2


def test_predicted_prefill_tokens_add_what_was_routed_since_the_report() -> None:
    assert worker("a").predicted_prefill_tokens == 0
    assert worker("a", outstanding_prefill_tokens=300).predicted_prefill_tokens == 300
    # reported 1000 pending when 200 of ours were; 500 more of ours since
    assert worker("a", reported_prefill_tokens=1000, outstanding_prefill_tokens=700,
                  outstanding_prefill_at_report=200).predicted_prefill_tokens == 1500
    # ours reached their first token since the report: never below what we know waits
    assert worker("a", reported_prefill_tokens=100, outstanding_prefill_tokens=50,
                  outstanding_prefill_at_report=400).predicted_prefill_tokens == 50


def test_a_burst_spreads_before_any_load_report() -> None:
    workers = {name: worker(name, reported_load=None) for name in ("a", "b", "c")}
    picks = []
    for routed in range(1, 7):
        pick = chosen(list(workers.values()))
        assert pick is not None
        picks.append(pick)
        view = workers[pick]
        workers[pick] = replace(view, in_flight=view.in_flight + 1, last_routed=routed)
    assert sorted(picks) == ["a", "a", "b", "b", "c", "c"]


def test_ties_go_round_robin_then_by_id_deterministically() -> None:
    assert chosen([worker("b"), worker("a")]) == "a"
    assert chosen([worker("a", last_routed=5), worker("b", last_routed=2)]) == "b"
    workers = [worker("x", last_routed=1), worker("y", last_routed=1)]
    assert {chosen(workers) for _ in range(10)} == {"x"}


def test_context_limit_is_the_longest_among_serving_workers() -> None:
    workers = [worker("a", max_model_len=512), worker("b", max_model_len=2048),
               worker("c", max_model_len=8192, status=WorkerStatus.DRAINING)]
    assert context_limit(workers, "m") == 2048
    assert context_limit(workers, "other") is None
    assert chosen(workers, RouteRequest(model="m", prompt_tokens=500, total_tokens=1000)) == "b"


# ---- prefill/decode pairs ------------------------------------------------------------


def test_without_prefill_workers_the_single_worker_policy_decides() -> None:
    workers = [worker("a", reported_load=2), worker("b", role=DECODE, reported_load=1)]
    assert decide(workers, REQUEST) == single("no_prefill_worker", "b")
    draining = worker("p", role=PREFILL, status=WorkerStatus.DRAINING)
    assert decide([*workers, draining], REQUEST) == single("no_prefill_worker", "b")


def test_the_pair_is_the_least_loaded_prefill_and_decode_worker() -> None:
    workers = [worker("p1", role=PREFILL, reported_load=2), worker("p2", role=PREFILL, reported_load=0),
               worker("d1", role=DECODE, reported_load=0), worker("d2", role=DECODE, reported_load=3),
               worker("both", role=BOTH, reported_load=1)]  # never half of a pair
    assert decide(workers, REQUEST) == pair("p2", "d1")
    # prefill workers are loaded by the prompt tokens queued on them
    workers[1] = replace(workers[1], reported_prefill_tokens=900)
    assert decide(workers, REQUEST) == pair("p1", "d1")


def test_pairs_share_a_compatibility_hash() -> None:
    # the lightest decode worker has another hash than the lightest prefill worker
    workers = [worker("p-old", role=PREFILL, compat_hash="old", reported_load=0),
               worker("d-new", role=DECODE, compat_hash="new", reported_load=0),
               worker("d-old", role=DECODE, compat_hash="old", reported_load=5)]
    assert decide(workers, REQUEST) == pair("p-old", "d-old")
    # two hashes with a pair each: the lighter pair wins
    workers += [worker("p-new", role=PREFILL, compat_hash="new", reported_load=1)]
    assert decide(workers, REQUEST) == pair("p-new", "d-new")


def test_two_model_versions_at_once_pair_only_within_a_version() -> None:
    workers = [worker(f"{role.value[0]}-{version}", role=role, compat_hash=version, reported_load=None)
               for version in ("v1", "v2") for role in (PREFILL, DECODE)]
    for routed in range(1, 9):
        decision = decide(workers, REQUEST)
        assert isinstance(decision, RoutePlan) and decision.prefill_worker_id is not None
        assert decision.prefill_worker_id.split("-")[1] == decision.worker_id.split("-")[1]
        for name in (decision.prefill_worker_id, decision.worker_id):
            index = next(i for i, view in enumerate(workers) if view.worker_id == name)
            workers[index] = replace(workers[index], in_flight=workers[index].in_flight + 1, last_routed=routed)
    assert all(view.in_flight == 4 for view in workers)  # both versions took their share


def test_two_models_pair_only_within_a_model_even_with_equal_hashes() -> None:
    """A prefill worker of one model never pairs with a decode worker of another, even the
    lightest, and even if their compatibility hashes were equal."""
    workers = [worker("p-a", role=PREFILL, model="a", reported_load=3), worker("d-a", role=DECODE, model="a", reported_load=3),
               worker("p-b", role=PREFILL, model="b"), worker("d-b", role=DECODE, model="b")]
    for model in ("a", "b"):
        assert decide(workers, request(model=model)) == pair(f"p-{model}", f"d-{model}")
    crossed = [workers[1], workers[2]]  # model a's decode worker, model b's prefill worker
    assert decide(crossed, request(model="a")) == single("no_prefill_worker", "d-a")
    assert decide(crossed, request(model="b")) is None


def test_no_compatible_pair_falls_back_to_single_worker_serving() -> None:
    workers = [worker("p", role=PREFILL, compat_hash="a"), worker("d", role=DECODE, compat_hash="b", reported_load=1),
               worker("both", role=BOTH, compat_hash="b", reported_load=2)]
    assert decide(workers, REQUEST) == single("compat_hash_mismatch", "d")
    only_both = [worker("p", role=PREFILL), worker("both", role=BOTH)]
    assert decide(only_both, REQUEST) == single("no_decode_worker", "both")
    assert decide([worker("p", role=PREFILL)], REQUEST) is None


def test_context_limits_per_part() -> None:
    # the prefill worker needs room for the prompt and one token; the decode worker for everything
    workers = [worker("p", role=PREFILL, max_model_len=501), worker("d", role=DECODE, max_model_len=600)]
    assert decide(workers, REQUEST) == pair("p", "d")
    assert decide([replace(workers[0], max_model_len=500), workers[1]], REQUEST) == single("no_prefill_worker", "d")
    assert decide([workers[0], replace(workers[1], max_model_len=599)], REQUEST) is None


def test_pairs_spread_a_burst_over_both_roles() -> None:
    workers = {name: worker(name, role=PREFILL if name.startswith("p") else DECODE, reported_load=None)
               for name in ("p1", "p2", "d1", "d2")}
    picks = []
    for routed in range(1, 5):
        decision = decide(list(workers.values()), REQUEST)
        assert isinstance(decision, RoutePlan) and decision.prefill_worker_id is not None
        picks.append((decision.prefill_worker_id, decision.worker_id))
        for name in (decision.prefill_worker_id, decision.worker_id):
            view = workers[name]
            workers[name] = replace(view, in_flight=view.in_flight + 1, last_routed=routed)
    assert sorted(p for p, _ in picks) == ["p1", "p1", "p2", "p2"]
    assert sorted(d for _, d in picks) == ["d1", "d1", "d2", "d2"]


# ---- the cost model: where the prompt is cached ---------------------------------------


def test_a_prefix_heavy_request_goes_to_the_worker_holding_the_prefix() -> None:
    workers = [worker("a", reported_load=1), worker("b", reported_load=1)]
    held = {"b": 448}
    decision = decide(workers, request(cached_tokens=held, held_tokens=held))
    assert isinstance(decision, RoutePlan) and decision.worker_id == "b"
    assert decision.prompt is not None and (decision.prompt.cached_tokens, decision.prompt.uncached_tokens) == (448, 52)
    assert decision.prompt.holder_id is None


def test_a_busy_holder_lends_its_prefix_to_an_idle_worker() -> None:
    workers = [worker("a"), worker("b", reported_load=6)]
    held = {"b": 448}
    decision = decide(workers, request(cached_tokens=held, held_tokens=held))
    assert isinstance(decision, RoutePlan) and decision.worker_id == "a"
    assert decision.prompt is not None and decision.prompt.holder_id == "b"
    assert (decision.prompt.pulled_tokens, decision.prompt.uncached_tokens) == (448, 52)
    # only reported blocks are lent: predicted ones may not exist yet
    decision = decide(workers, request(cached_tokens=held))
    assert isinstance(decision, RoutePlan) and decision.prompt is not None and decision.prompt.holder_id is None


def test_prefixes_are_pulled_only_within_a_compatibility_hash() -> None:
    holders = Holders([worker("a", compat_hash="v1"), worker("b", compat_hash="v2"), worker("c", compat_hash="v1")],
                      {"a": 320, "b": 480})
    assert holders.best_for(worker("c", compat_hash="v1")) == (320, "a")
    assert holders.best_for(worker("a", compat_hash="v1")) == (0, None)  # never from itself
    plan = plan_prefill(worker("c", compat_hash="v1"), 500, {"c": 400}, holders)
    assert (plan.cached_tokens, plan.pulled_tokens, plan.holder_id, plan.uncached_tokens) == (400, 0, None, 100)


def test_sibling_requests_land_together_before_the_workers_events() -> None:
    """After the first sibling is routed, its worker is predicted to hold the shared prefix
    and has the prompt queued: the next siblings still prefer it to computing it again."""
    workers = {name: worker(name, max_num_seqs=64, reported_load=None) for name in ("a", "b")}
    picks = []
    predicted: dict[str, int] = {}
    for routed in range(1, 6):
        decision = decide(list(workers.values()), request(cached_tokens=predicted))
        assert isinstance(decision, RoutePlan) and decision.prompt is not None
        picks.append(decision.worker_id)
        view = workers[decision.worker_id]
        workers[decision.worker_id] = replace(
            view, in_flight=view.in_flight + 1, last_routed=routed,
            outstanding_prefill_tokens=view.outstanding_prefill_tokens + decision.prompt.uncached_tokens)
        predicted = {decision.worker_id: 496}  # the prompt's full blocks, speculatively
    assert picks == ["a"] * 5


# ---- conditional disaggregation ----------------------------------------------------------


def test_a_small_uncached_part_stays_on_the_decode_worker() -> None:
    workers = [worker("p", role=PREFILL), worker("d", role=DECODE)]
    assert decide(workers, REQUEST) == pair("p", "d")
    held = {"d": 448}  # a follow-up turn: the decode worker holds the conversation so far
    assert decide(workers, request(cached_tokens=held, held_tokens=held)) == single("small_uncached", "d")
    short = RouteRequest(model="m", prompt_tokens=100, total_tokens=200)
    assert decide(workers, short) == single("small_uncached", "d")
    assert decide(workers, short, RoutingConfig(kv_aware=ALWAYS_SPLIT)) == pair("p", "d")


def test_busy_prefill_workers_leave_the_prompt_to_the_decode_worker() -> None:
    workers = [worker("p1", role=PREFILL, reported_prefill_tokens=9000),
               worker("p2", role=PREFILL, outstanding_prefill_tokens=8192),
               worker("d1", role=DECODE, reported_load=2), worker("d2", role=DECODE)]
    assert decide(workers, REQUEST) == single("prefill_busy", "d2")
    workers[1] = replace(workers[1], outstanding_prefill_tokens=100)
    assert decide(workers, REQUEST) == pair("p2", "d2")
    # past its queue limit counts as busy too
    workers[1] = replace(workers[1], reported_load=40)
    assert decide(workers, REQUEST) == single("prefill_busy", "d2")


def test_a_both_worker_competes_with_the_pairs_on_cost() -> None:
    held = {"both": 480}
    workers = [worker("p", role=PREFILL), worker("d", role=DECODE), worker("both", role=BOTH)]
    assert decide(workers, REQUEST) == pair("p", "d")  # equal cost: disaggregate
    assert decide(workers, request(cached_tokens=held, held_tokens=held)) == single("single_cheaper", "both")


# ---- admission control --------------------------------------------------------------------


def test_every_candidate_past_its_queue_limit_is_a_refusal() -> None:
    routing = RoutingConfig(max_queue_factor=2.0)  # 16 requests per worker of 8 slots
    workers = [worker("a", reported_load=16), worker("b", reported_load=20), worker("p", role=PREFILL)]
    assert decide(workers, REQUEST, routing) == RouteRefusal("overloaded")
    assert decide(workers, request(admit=False), routing) == single("no_decode_worker", "a")  # a resumed request
    assert chosen([*workers, worker("c", reported_load=15)], REQUEST, routing) == "c"
    assert chosen(workers, REQUEST, RoutingConfig(max_queue_factor=0)) == "a"  # off


# ---- decode-first: the cache-hit threshold --------------------------------------------------


def test_the_cache_hit_threshold_serves_from_a_warm_worker_or_refuses() -> None:
    workers = [worker("p", role=PREFILL), worker("d1", role=DECODE), worker("d2", role=DECODE, reported_load=3)]
    cached = {"d2": 320}  # 64% of the prompt
    assert decide(workers, request(cached_tokens=cached, cache_hit_threshold=0.6)) == single("decode_first", "d2")
    assert decide(workers, request(cached_tokens=cached, cache_hit_threshold=0.65)) == \
        RouteRefusal("cache_threshold", "d2", 320)
    assert decide(workers, request(cache_hit_threshold=0.1)) == RouteRefusal("cache_threshold", "d1", 0)


def test_routing_settings_are_validated() -> None:
    RoutingConfig().validate()
    for bad in (dict(cache_hit_threshold=1.5), dict(prefill_weight=-1.0), dict(max_queue_factor=0.5),
                dict(kv_aware=KvAwareConfig(local_prefill_tokens=-1)), dict(retry_after_s=0), dict(speculative_ttl_s=0.0)):
        with pytest.raises(ConfigError):
            RoutingConfig(**bad).validate()


def test_a_worker_without_a_data_plane_is_a_transfer_group_of_its_own() -> None:
    from services.router.fleet.worker_state import transfer_group
    from shared.schemas import WorkerCapacity, WorkerRegistration, WorkerRole

    def registration(worker_id: str, kv_transfer: bool) -> WorkerRegistration:
        return WorkerRegistration(worker_id=worker_id, role=WorkerRole.DECODE, model="m", engine="sim", block_size=16,
                                  compat_hash="c1", kv_transfer=kv_transfer, started_at=0.0, heartbeat_at=0.0,
                                  capacity=WorkerCapacity(kv_blocks=8, max_num_seqs=4, max_model_len=64))

    assert transfer_group(registration("a", True)) == transfer_group(registration("b", True)) == "c1"
    assert transfer_group(registration("a", False)) != transfer_group(registration("b", False))
    assert transfer_group(registration("a", False)) != "c1"


def test_baseline_policies_ignore_the_cache() -> None:
    workers = [worker(f"w{i}", last_routed=i + 1) for i in range(3)]
    cached = request(cached_tokens={"w2": 496}, held_tokens={"w2": 496})
    assert decide(workers, cached).worker_id == "w2"  # kv-aware follows the cache
    round_robin = decide(workers, cached, RoutingConfig(policy="round-robin"))
    assert round_robin.worker_id == "w0" and round_robin.reason == "baseline"  # picked longest ago
    picks = {decide(workers, request(draw=draw), RoutingConfig(policy="random")).worker_id for draw in (0.0, 0.4, 0.9)}
    assert picks == {"w0", "w1", "w2"}


# ---- KV transfer mode of a disaggregated pair ----------------------------------------


@pytest.mark.parametrize(("pd_transfer", "kv_push", "prefix_pull", "mode"), [
    ("pull", (True, True), False, "pull"),
    ("push", (True, True), False, "push"),
    ("push", (True, False), False, "pull"),  # e.g. a vLLM decode worker: its connector only pulls
    ("push", (False, True), False, "pull"),
    ("push", (False, False), False, "pull"),
    ("push", (True, True), True, "pull"),  # a pushing prefill worker pulls no cached prefix
])
def test_push_only_where_both_engines_implement_it(pd_transfer: str, kv_push: tuple[bool, bool], prefix_pull: bool,
                                                   mode: str) -> None:
    routing = RoutingConfig(pd_transfer=pd_transfer)  # type: ignore[arg-type]
    prefill = worker("p", role=PREFILL, kv_push=kv_push[0])
    decode = worker("d", role=DECODE, kv_push=kv_push[1])
    assert kv_transfer_mode(routing, prefill, decode, prefix_pull=prefix_pull) == mode


def test_pd_transfer_is_validated() -> None:
    RoutingConfig(pd_transfer="push").validate()
    with pytest.raises(ConfigError, match="pd_transfer"):
        RoutingConfig(pd_transfer="teleport").validate()  # type: ignore[arg-type]
