"""Routing policy on plain data: eligibility, least-loaded choice, predicted load, ties."""

from __future__ import annotations

from dataclasses import replace

from services.router.policy import RouteRequest, WorkerView, choose_worker, context_limit
from shared.schemas import WorkerRole, WorkerStatus


def worker(worker_id: str, **overrides) -> WorkerView:
    fields = dict(worker_id=worker_id, model="m", role=WorkerRole.BOTH, status=WorkerStatus.ACTIVE,
                  max_num_seqs=8, max_model_len=1024, reported_load=0, in_flight=0, in_flight_at_report=0,
                  last_routed=0)
    fields.update(overrides)
    return WorkerView(**fields)


REQUEST = RouteRequest(model="m", total_tokens=100)


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
    assert choose_worker(workers, RouteRequest(model="m", total_tokens=1000)) == "b"
