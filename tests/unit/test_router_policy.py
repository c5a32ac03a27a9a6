"""Routing policy on plain data: eligibility, least-loaded choice, predicted load, ties, and the
prefill/decode pair of the disaggregated flow (load, compatibility hash, fallbacks)."""

from __future__ import annotations

from dataclasses import replace

from services.router.policy import RouteDecision, RouteRequest, WorkerView, choose_worker, context_limit, decide
from shared.schemas import WorkerRole, WorkerStatus


def worker(worker_id: str, **overrides) -> WorkerView:
    fields = dict(worker_id=worker_id, model="m", role=WorkerRole.BOTH, status=WorkerStatus.ACTIVE,
                  max_num_seqs=8, max_model_len=1024, reported_load=0, in_flight=0, in_flight_at_report=0,
                  last_routed=0, compat_hash="h")
    fields.update(overrides)
    return WorkerView(**fields)


REQUEST = RouteRequest(model="m", prompt_tokens=50, total_tokens=100)


def test_no_workers_means_no_choice() -> None:
    assert choose_worker([], REQUEST) is None


def test_only_active_workers_of_the_model_with_a_serving_role_qualify() -> None:
    workers = [
        worker("draining", status=WorkerStatus.DRAINING),
        worker("prefill", role=WorkerRole.PREFILL),
        worker("other-model", model="other"),
        worker("short-context", max_model_len=50),
    ]
    assert choose_worker(workers, REQUEST) is None
    assert choose_worker([*workers, worker("decode", role=WorkerRole.DECODE)], REQUEST) == "decode"


def test_least_loaded_relative_to_capacity() -> None:
    workers = [worker("a", reported_load=3), worker("b", reported_load=1), worker("c", reported_load=2)]
    assert choose_worker(workers, REQUEST) == "b"
    # 4 of 16 slots is lighter than 3 of 8
    assert choose_worker([worker("a", reported_load=3), worker("big", reported_load=4, max_num_seqs=16)],
                         REQUEST) == "big"


def test_predicted_load_adds_requests_routed_since_the_report() -> None:
    # reported 2 when we had 0 in flight; we have routed 3 since: 5
    assert worker("a", reported_load=2, in_flight=3, in_flight_at_report=0).predicted_load == 5
    # reported 4 counting our 3; 2 of ours finished since: 2
    assert worker("a", reported_load=4, in_flight=1, in_flight_at_report=3).predicted_load == 2
    # never below what we know is in flight
    assert worker("a", reported_load=0, in_flight=2, in_flight_at_report=2).predicted_load == 2
    assert worker("a", reported_load=None, in_flight=2).predicted_load == 2


def test_a_burst_spreads_before_any_load_report() -> None:
    workers = {name: worker(name, reported_load=None) for name in ("a", "b", "c")}
    picks = []
    for routed in range(1, 7):
        chosen = choose_worker(list(workers.values()), REQUEST)
        assert chosen is not None
        picks.append(chosen)
        view = workers[chosen]
        workers[chosen] = replace(view, in_flight=view.in_flight + 1, last_routed=routed)
    assert sorted(picks) == ["a", "a", "b", "b", "c", "c"]


def test_ties_go_round_robin_then_by_id_deterministically() -> None:
    assert choose_worker([worker("b"), worker("a")], REQUEST) == "a"
    assert choose_worker([worker("a", last_routed=5), worker("b", last_routed=2)], REQUEST) == "b"
    workers = [worker("x", last_routed=1), worker("y", last_routed=1)]
    assert {choose_worker(workers, REQUEST) for _ in range(10)} == {"x"}


def test_context_limit_is_the_longest_among_serving_workers() -> None:
    workers = [worker("a", max_model_len=512), worker("b", max_model_len=2048),
               worker("c", max_model_len=8192, status=WorkerStatus.DRAINING)]
    assert context_limit(workers, "m") == 2048
    assert context_limit(workers, "other") is None
    assert choose_worker(workers, RouteRequest(model="m", prompt_tokens=500, total_tokens=1000)) == "b"


# ---- prefill/decode pairs ------------------------------------------------------------

PREFILL, DECODE, BOTH = WorkerRole.PREFILL, WorkerRole.DECODE, WorkerRole.BOTH


def pair(prefill: str, decode: str) -> RouteDecision:
    return RouteDecision("disaggregated", "pair", decode, prefill_worker_id=prefill)


def test_without_prefill_workers_the_single_worker_policy_decides() -> None:
    workers = [worker("a", reported_load=2), worker("b", role=DECODE, reported_load=1)]
    assert decide(workers, REQUEST) == RouteDecision("single", "no_prefill_worker", "b")
    assert decide([], REQUEST) is None
    draining = worker("p", role=PREFILL, status=WorkerStatus.DRAINING)
    assert decide([*workers, draining], REQUEST) == RouteDecision("single", "no_prefill_worker", "b")


def test_the_pair_is_the_least_loaded_prefill_and_decode_worker() -> None:
    workers = [worker("p1", role=PREFILL, reported_load=2), worker("p2", role=PREFILL, reported_load=0),
               worker("d1", role=DECODE, reported_load=0), worker("d2", role=DECODE, reported_load=3),
               worker("both", role=BOTH, reported_load=0)]  # never half of a pair
    assert decide(workers, REQUEST) == pair("p2", "d1")


def test_pairs_share_a_compatibility_hash() -> None:
    # the lightest decode worker has another hash than the lightest prefill worker
    workers = [worker("p-old", role=PREFILL, compat_hash="old", reported_load=0),
               worker("d-new", role=DECODE, compat_hash="new", reported_load=0),
               worker("d-old", role=DECODE, compat_hash="old", reported_load=5)]
    assert decide(workers, REQUEST) == pair("p-old", "d-old")
    # two hashes with a pair each: the lighter pair wins
    workers += [worker("p-new", role=PREFILL, compat_hash="new", reported_load=1)]
    assert decide(workers, REQUEST) == pair("p-new", "d-new")


def test_no_compatible_pair_falls_back_to_single_worker_serving() -> None:
    workers = [worker("p", role=PREFILL, compat_hash="a"), worker("d", role=DECODE, compat_hash="b", reported_load=1),
               worker("both", role=BOTH, compat_hash="b", reported_load=2)]
    assert decide(workers, REQUEST) == RouteDecision("single", "compat_hash_mismatch", "d")
    only_both = [worker("p", role=PREFILL), worker("both", role=BOTH)]
    assert decide(only_both, REQUEST) == RouteDecision("single", "no_decode_worker", "both")
    assert decide([worker("p", role=PREFILL)], REQUEST) is None  # a prefill worker never serves whole requests


def test_context_limits_per_part() -> None:
    # the prefill worker needs room for the prompt and one token; the decode worker for everything
    workers = [worker("p", role=PREFILL, max_model_len=51), worker("d", role=DECODE, max_model_len=100)]
    assert decide(workers, REQUEST) == pair("p", "d")
    assert decide([replace(workers[0], max_model_len=50), workers[1]], REQUEST) == \
        RouteDecision("single", "no_prefill_worker", "d")
    assert decide([workers[0], replace(workers[1], max_model_len=99)], REQUEST) is None


def test_pairs_spread_a_burst_over_both_roles() -> None:
    workers = {name: worker(name, role=PREFILL if name.startswith("p") else DECODE, reported_load=None)
               for name in ("p1", "p2", "d1", "d2")}
    picks = []
    for routed in range(1, 5):
        decision = decide(list(workers.values()), REQUEST)
        assert decision is not None and decision.prefill_worker_id is not None
        picks.append((decision.prefill_worker_id, decision.worker_id))
        for name in (decision.prefill_worker_id, decision.worker_id):
            view = workers[name]
            workers[name] = replace(view, in_flight=view.in_flight + 1, last_routed=routed)
    assert sorted(p for p, _ in picks) == ["p1", "p1", "p2", "p2"]
    assert sorted(d for _, d in picks) == ["d1", "d1", "d2", "d2"]
