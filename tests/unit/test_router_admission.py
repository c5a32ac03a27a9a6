"""The router's admission policy, pure: priorities, the keys' fair share (virtual token
counters), shedding, the reserve, per-key tokens per minute; with plain data and the time given."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from services.router.config import AdmissionConfig
from services.router.routing.admission import AdmissionQueue, Ask, Tenant, TokenBudgets, resolve_priority
from services.router.routing.admission.fair_share import VirtualTokenCounters, service_tokens

_ids = itertools.count()


def ask(key: str = "", priority: int = 0, cost: float = 10.0, weight: float = 1.0, sheddable: bool = False) -> Ask:
    return Ask(f"r{next(_ids)}", Tenant(key=key, weight=weight, priority=priority), cost, sheddable)


def queue(**config) -> AdmissionQueue:
    return AdmissionQueue(AdmissionConfig(slots_per_seq=1.0, **config))


def all_waiting(asks: list[Ask]) -> AdmissionQueue:
    """A one-slot queue where `asks` all arrived while another request held the slot, which
    has just ended: every one of them waits, in arrival order."""
    admission = queue()
    blocker = ask("x")
    admission.push(blocker, 1)
    for one in asks:
        admission.push(one, 1)
    admission.finish(blocker, 10.0)
    return admission


def serve(admission: AdmissionQueue, count: int) -> list[str]:
    """The keys of the next `count` requests started, one at a time, each served its cost."""
    served = []
    for _ in range(count):
        (started,) = admission.pop(1)
        served.append(started.tenant.key)
        admission.finish(started, started.cost)
    return served


# --- priorities


def test_priority_is_the_request_s_else_the_key_s_default_never_above_the_key_s_top() -> None:
    assert resolve_priority(None, None, None) == 0
    assert resolve_priority(3, None, None) == 3
    assert resolve_priority(None, 5, None) == 5
    assert resolve_priority(-2, 5, None) == -2  # the request's own wins over its key's default
    assert resolve_priority(-10, None, -1) == -1  # more urgent than the key may ask: raised to its top
    assert resolve_priority(None, -5, 0) == 0
    assert resolve_priority(4, None, -1) == 4  # less urgent than the top: kept


def test_without_priorities_or_keys_requests_start_first_come_first_served() -> None:
    admission = queue()
    first, second, third = ask(), ask(), ask()
    assert admission.push(first, capacity=1).start
    assert not admission.push(second, capacity=1).start
    assert not admission.push(third, capacity=1).start
    assert admission.pop(capacity=1) == []  # nothing ended: no slot
    admission.finish(first, served=10.0)
    assert admission.pop(capacity=1) == [second]
    admission.finish(second, served=10.0)
    assert admission.pop(capacity=1) == [third]


def test_the_most_urgent_priority_starts_first_whatever_its_arrival() -> None:
    admission = queue()
    running = ask(priority=0)
    admission.push(running, capacity=1)
    late, urgent, later = ask(priority=5), ask(priority=-1), ask(priority=0)
    for waiting in (late, urgent, later):
        assert not admission.push(waiting, capacity=1).start
    admission.finish(running, 10.0)
    assert admission.pop(capacity=1) == [urgent]
    admission.finish(urgent, 10.0)
    assert admission.pop(capacity=1) == [later]
    admission.finish(later, 10.0)
    assert admission.pop(capacity=1) == [late]


def test_a_new_request_does_not_overtake_waiting_ones_of_its_priority_when_a_slot_frees() -> None:
    admission = queue()
    running, waiting = ask(), ask()
    admission.push(running, 1)
    admission.push(waiting, 1)
    admission.finish(running, 10.0)  # the adapter pops next; a push in between must not take the slot
    newcomer = ask()
    assert not admission.push(newcomer, 1).start
    assert admission.pop(1) == [waiting]


def test_the_reserve_keeps_slots_free_for_urgent_requests() -> None:
    admission = queue(reserve_share=0.25)
    normal = [ask(priority=0) for _ in range(4)]
    assert [admission.push(one, capacity=4).start for one in normal] == [True, True, True, False]
    assert admission.push(ask(priority=-1), capacity=4).start  # the reserved slot
    assert not admission.push(ask(priority=-1), capacity=4).start  # capacity reached


# --- fair share


def test_two_backlogged_keys_of_equal_weight_share_starts_equally_whatever_their_offered_load() -> None:
    heavy = [ask("heavy") for _ in range(30)]
    light = [ask("light") for _ in range(10)]
    served = serve(all_waiting(heavy[:15] + light + heavy[15:]), 20)  # 3:1 offered, the heavy key first
    assert served.count("heavy") == 10 and served.count("light") == 10


def test_weights_share_in_proportion() -> None:
    admission = all_waiting([one for _ in range(30) for one in (ask("gold", weight=2.0), ask("plain", weight=1.0))])
    served = serve(admission, 30)
    assert served.count("gold") == 20 and served.count("plain") == 10


def test_a_key_that_becomes_active_starts_at_the_least_active_counter() -> None:
    counters = VirtualTokenCounters()
    counters.activate("busy")
    counters.charge("busy", 1000.0, 1.0)
    counters.activate("other")  # idle until now, with no history: lifted, so it earns no credit
    assert counters.counter("other") == 1000.0
    counters.deactivate("busy")
    counters.deactivate("other")
    counters.activate("busy")  # nobody active: keeps its own
    assert counters.counter("busy") == 1000.0


def test_a_finished_request_charges_what_it_was_served_not_its_estimate() -> None:
    admission = queue()
    one = ask("k", cost=service_tokens(100, 50))
    admission.push(one, 1)
    assert admission.counters.counter("k") == 200.0
    admission.finish(one, served=service_tokens(100, 10))
    assert admission.counters.counter("k") == 120.0


# --- refusals


def test_a_sheddable_request_never_waits() -> None:
    admission = queue()
    assert admission.push(ask(sheddable=True), 1).start  # a free slot: it runs
    shed = ask(sheddable=True)
    assert admission.push(shed, 1).refused == (shed,)
    assert len(admission) == 0


def test_a_full_queue_sheds_the_least_urgent_waiting_request_for_a_more_urgent_one() -> None:
    admission = queue(max_queued=2)
    admission.push(ask(), 1)
    low, normal = ask(priority=3), ask(priority=0)
    admission.push(low, 1)
    admission.push(normal, 1)
    urgent = ask(priority=-1)
    assert admission.push(urgent, 1).refused == (low,)
    another_low = ask(priority=3)
    assert admission.push(another_low, 1).refused == (another_low,)  # it would be served last
    assert len(admission) == 2


def test_within_a_priority_a_full_queue_sheds_the_key_served_most() -> None:
    admission = queue(max_queued=2)
    running = ask("heavy", cost=500.0)
    admission.push(running, 1)
    first, second = ask("heavy"), ask("heavy")
    admission.push(first, 1)
    admission.push(second, 1)
    light = ask("light")
    assert admission.push(light, 1).refused == (second,)  # the heavy key's newest


def test_a_withdrawn_request_leaves_the_queue_and_its_key() -> None:
    admission = queue()
    running, waiting = ask("a"), ask("b")
    admission.push(running, 1)
    admission.push(waiting, 1)
    assert admission.withdraw(waiting) and not admission.withdraw(waiting)
    assert len(admission) == 0 and admission.counters.active_keys == ["a"]
    admission.finish(running, 10.0)
    assert admission.pop(1) == [] and admission.counters.active_keys == []


# --- properties


operations = st.lists(st.tuples(st.sampled_from(["push", "finish", "withdraw"]), st.integers(-1, 2),
                                st.sampled_from(["a", "b", "c"]), st.booleans()), max_size=80)


@settings(max_examples=150, deadline=None)
@given(operations, st.integers(1, 4), st.integers(0, 5), st.sampled_from([0.0, 0.5]))
def test_every_request_is_started_refused_or_waiting_and_never_past_capacity(ops, capacity, max_queued,
                                                                          reserve) -> None:
    admission = queue(max_queued=max_queued, reserve_share=reserve)
    running: list[Ask] = []
    waiting: list[Ask] = []
    for operation, priority, key, sheddable in ops:
        if operation == "push":
            pushed = ask(key, priority, sheddable=sheddable)
            verdict = admission.push(pushed, capacity)
            waiting.append(pushed)
            for refused in verdict.refused:
                waiting.remove(refused)
            if verdict.start:
                waiting.remove(pushed)
                running.append(pushed)
        elif operation == "finish" and running:
            admission.finish(running.pop(0), 10.0)
        elif operation == "withdraw" and waiting:
            assert admission.withdraw(waiting.pop())
        for started in admission.pop(capacity):
            waiting.remove(started)
            running.append(started)
        assert admission.running == len(running) <= capacity
        assert len(admission) == len(waiting) <= max_queued
        assert not any(one.sheddable for one in waiting)
        if waiting:  # a slot a waiting request may take is taken
            most_urgent = min(one.tenant.priority for one in waiting)
            assert admission.running >= admission.limit(most_urgent, capacity)
    assert sorted(admission.counters.active_keys) == sorted({one.tenant.key for one in running + waiting})


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["a", "b"]), min_size=1, max_size=60), st.integers(1, 50), st.integers(1, 50))
def test_two_backlogged_keys_never_drift_apart_by_more_than_one_request(arrivals, cost_a, cost_b) -> None:
    """VTC's bound: while both keys wait, their counters stay within the largest request of each."""
    costs = {"a": float(cost_a), "b": float(cost_b)}
    admission = all_waiting([ask(key, cost=costs[key]) for key in ["a", "b"] + arrivals + ["a", "b"] * 60])
    while True:
        serve(admission, 1)
        backlogged = {one for lane in admission._waiting.values() for one in lane}
        if backlogged != {"a", "b"}:
            break
        gap = abs(admission.counters.counter("a") - admission.counters.counter("b"))
        assert gap <= max(costs.values())


# --- tokens per minute


def test_a_key_s_token_budget_lets_one_request_into_debt_then_refuses_until_paid() -> None:
    budgets = TokenBudgets()
    assert budgets.take("k", 600, 500, now=0.0) == 0.0
    assert budgets.take("k", 600, 500, now=0.0) == 0.0  # 100 left: taken, 400 in debt
    wait_s = budgets.take("k", 600, 1, now=0.0)
    assert wait_s == (1 + 400) / 10.0  # 10 tokens a second
    assert budgets.take("k", 600, 1, now=wait_s) == 0.0
    assert budgets.take("other", 600, 1, now=0.0) == 0.0  # per key


def test_a_token_budget_gets_back_what_a_request_did_not_use() -> None:
    budgets = TokenBudgets()
    budgets.take("k", 600, 700, now=0.0)
    assert budgets.take("k", 600, 1, now=0.0) > 0
    budgets.correct("k", 300, now=0.0)  # it used 400 of its 700
    assert budgets.take("k", 600, 1, now=0.0) == 0.0
