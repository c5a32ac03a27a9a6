"""The routing sweep's oracle: affinity under a load cap, with plain data."""

from __future__ import annotations

import pytest

from bench.routing.oracle import GroupSpec, Oracle, assign, load_cap, replicas_for

WORKERS = ["w1", "w2", "w3", "w4"]


def uniform(count: int, prefix: int, total_share: float = 1.0) -> dict[str, GroupSpec]:
    return {f"tenant-{index}": GroupSpec(prefix, total_share / count) for index in range(count)}


def test_groups_that_fit_respect_every_workers_cache() -> None:
    groups = uniform(12, 1000)
    placement, plans = assign(groups, WORKERS, capacity_tokens=3000, cap=load_cap(4))
    assert all(len(workers) == 1 for workers in placement.values())
    assert all(plan.cache_tokens <= 3000 for plan in plans.values())
    assert sorted(len(plan.groups) for plan in plans.values()) == [3, 3, 3, 3]
    uneven = {"a": GroupSpec(2500, 0.1), "b": GroupSpec(2500, 0.1), "c": GroupSpec(400, 0.3), "d": GroupSpec(400, 0.3)}
    _, plans = assign(uneven, ["w1", "w2"], capacity_tokens=3000, cap=0.6)
    assert all(plan.cache_tokens <= 3000 for plan in plans.values())  # one big and one small per worker


def test_load_cap_holds_and_skew_does_not_pile_onto_one_worker() -> None:
    cap = load_cap(4, slack=0.2)
    assert cap == pytest.approx(0.3)
    shares = [0.25, 0.2, 0.15, 0.1, 0.1, 0.08, 0.07, 0.05]
    groups = {f"t{index}": GroupSpec(100, share) for index, share in enumerate(shares)}
    _, plans = assign(groups, WORKERS, capacity_tokens=10_000, cap=cap)
    assert all(plan.load <= cap + 1e-9 for plan in plans.values())
    assert sum(plan.load for plan in plans.values()) == pytest.approx(1.0)


def test_a_hot_group_is_replicated_onto_enough_workers() -> None:
    cap = load_cap(4, slack=0.2)
    assert replicas_for(0.7, cap, 4) == 3 and replicas_for(0.3, cap, 4) == 1 and replicas_for(5.0, cap, 4) == 4
    groups = {"hot": GroupSpec(500, 0.7), "cold-a": GroupSpec(500, 0.15), "cold-b": GroupSpec(500, 0.15)}
    placement, plans = assign(groups, WORKERS, capacity_tokens=2000, cap=cap)
    assert len(placement["hot"]) == 3 and len(set(placement["hot"])) == 3
    assert all(plan.load <= cap + 1e-9 for plan in plans.values())
    oracle = Oracle(WORKERS, 2000, groups)
    outstanding = {worker: 0 for worker in WORKERS}
    picked = []
    for _ in range(6):  # the client's own count spreads the hot group over its replicas
        worker = oracle.pick("hot", outstanding)
        outstanding[worker] += 1
        picked.append(worker)
    assert set(picked) == set(placement["hot"]) and max(outstanding.values()) == 2


def test_placement_is_deterministic_whatever_the_order_given() -> None:
    groups = {f"t{index}": GroupSpec(300 + 50 * (index % 3), 1.0 / 10) for index in range(10)}
    first, _ = assign(groups, WORKERS, 1000, load_cap(4))
    again, _ = assign(dict(reversed(list(groups.items()))), WORKERS, 1000, load_cap(4))
    assert first == again


def test_groups_that_fit_nowhere_weigh_their_misses_and_spread_by_load() -> None:
    groups = {"big": GroupSpec(900, 0.3), "mid": GroupSpec(600, 0.2),
              **{f"over-{index}": GroupSpec(800, 0.05, miss_cost=4.0) for index in range(4)}}
    placement, plans = assign(groups, ["w1", "w2"], capacity_tokens=1000, cap=0.6)
    assert placement["big"] != placement["mid"]
    overflow = [placement[f"over-{index}"][0] for index in range(4)]
    assert overflow.count("w1") == 2 and overflow.count("w2") == 2  # not all onto the worker with most cache left
    assert plans["w1"].load == pytest.approx(0.3 + 2 * 0.2) and plans["w2"].load == pytest.approx(0.2 + 2 * 0.2)


def test_pick_prefers_the_groups_primary_then_the_least_outstanding() -> None:
    oracle = Oracle(WORKERS, 5000, uniform(4, 1000))
    home = oracle.workers_of("tenant-2")
    assert len(home) == 1
    assert oracle.pick("tenant-2", {"w1": 9, "w2": 9, "w3": 9, "w4": 9}) == home[0]
    assert oracle.pick(None, {"w1": 3, "w2": 1, "w3": 1, "w4": 2}) == "w2"  # unique: least outstanding
    assert oracle.pick("unknown-group", {"w1": 1, "w2": 0}) == "w2"  # no placement: least outstanding


def test_conversations_are_placed_on_first_sight_and_released_at_their_end() -> None:
    oracle = Oracle(WORKERS, 3000, {}, dynamic_spec=GroupSpec(1000, 0.05))
    first = oracle.workers_of("conv-1")
    assert oracle.workers_of("conv-1") == first  # sticky
    placed = [oracle.workers_of(f"conv-{index}")[0] for index in range(2, 9)]
    assert sorted(plan.cache_tokens for plan in oracle.plans.values()) == [2000, 2000, 2000, 2000]
    assert {*placed, first[0]} == set(WORKERS)
    oracle.release("conv-1")
    assert "conv-1" not in oracle.placement and oracle.plans[first[0]].cache_tokens == 1000
    assert oracle.workers_of("conv-9") == first  # the room it left is taken again
    oracle.release("tenant-unknown")  # a static or unknown group: nothing to release


def test_an_oracle_needs_workers() -> None:
    with pytest.raises(ValueError, match="at least one worker"):
        Oracle([], 1000, {})


def test_a_learning_oracle_places_share_blind_then_by_the_shares_it_counted() -> None:
    groups = {"hot": GroupSpec(1000, 0.7), **{f"cold-{index}": GroupSpec(1000, 0.1) for index in range(3)}}
    knowing = Oracle(["w1", "w2"], 3000, groups)
    oracle = Oracle(["w1", "w2"], 3000, groups, learn_requests=8)
    assert oracle.learning and oracle.placement == {}
    # first sight, share-blind: each group onto the worker with the fewest groups
    assert [oracle.workers_of(name)[0] for name in ("cold-0", "cold-1", "hot", "cold-2")] == ["w1", "w2", "w1", "w2"]
    for _ in range(3):
        assert oracle.workers_of("hot") == ["w1"]  # counted, still where it was placed
    assert oracle.learning and oracle.counted.total() == 7
    oracle.workers_of("hot")  # the 8th: hot drew 5 of 8, the cold ones 1 each
    assert not oracle.learning
    assert oracle.placement == knowing.placement  # the counted shares order the groups as the true ones do
    assert len(oracle.placement["hot"]) == 2  # 5/8 is more than one worker carries: two copies
    assert sum(plan.load for plan in oracle.plans.values()) == pytest.approx(1.0)
    oracle.workers_of("hot")
    assert oracle.counted.total() == 8  # learning is over: no more counting


def test_a_learning_oracle_rejects_a_bad_budget_and_learns_only_groups_known_up_front() -> None:
    with pytest.raises(ValueError, match="negative"):
        Oracle(WORKERS, 1000, uniform(2, 100), learn_requests=-1)
    with pytest.raises(ValueError, match="dynamic_spec"):
        Oracle(WORKERS, 1000, uniform(2, 100), dynamic_spec=GroupSpec(100, 0.1), learn_requests=4)
    conversations = Oracle(WORKERS, 3000, {}, dynamic_spec=GroupSpec(1000, 0.05), learn_requests=4)
    assert not conversations.learning and conversations.workers_of("conv-1")  # nothing to learn: as without
