"""Transient prefixes on plain data: past the cluster's KV, the recurring prefixes that are not
resident miss wherever they go (`routing.placement.homes.PrefixHomes.transient`), so their homes are
balanced by work, a miss weighing several hits (`PrefixHomes.work_shares`), and a home that
brings far more work than another gives one up (`routing.placement.rules`); which prefixes are
resident holds as close counts wander (`routing.placement.residency`)."""

from __future__ import annotations

import pytest

from services.router.config import RoutingConfig
from services.router.routing.placement.homes import DEFAULT_OVERHEAD_TOKENS, PrefixHomes
from services.router.routing.placement.residency import RESIDENT_FILL, RESIDENT_HOLD, rank_residents
from services.router.routing.placement.resident_prefixes import RESIDENCY_EVERY
from services.router.routing.placement.snapshot import snapshot_of
from tests.unit.test_router_homes import PROMPT, pick, route, sized, worker

HIT = 64  # prompt tokens a cached prompt computes (a miss computes all of `PROMPT`)


def recorded(homes: PrefixHomes, counts: tuple[tuple[int, str, int], ...], misses: frozenset[int] = frozenset(),
             ) -> PrefixHomes:
    """`count` requests of each prefix `key` on worker `name`: misses for the keys in `misses`,
    hits for the others."""
    for key, name, count in counts:
        for _ in range(count):
            homes.record(key, name, PROMPT, computed=PROMPT if key in misses else HIT)
    return homes


def test_recurring_prefixes_that_are_not_resident_are_transient() -> None:
    """6 prompts on 2 workers of 2600 tokens: 75% of the cluster's KV holds 3 of them. Of the
    others, 4 and 5 recur (transient), 6 was seen once (not yet). Without a KV pool known,
    nothing is transient; with one worker left, prefix 2 is transient too."""
    counts = ((1, "a", 9), (2, "a", 8), (3, "b", 7), (4, "a", 2), (5, "b", 3), (6, "b", 1))
    unsized = recorded(PrefixHomes(horizon=10_000), counts)
    assert not unsized.limited() and not unsized.transient(4)
    homes = sized(recorded(PrefixHomes(horizon=10_000), counts), "ab", kv_tokens=2600)
    assert homes.limited()
    assert [key for key in range(1, 7) if homes.transient(key)] == [4, 5]
    assert not homes.transient(99)  # never seen
    homes.forget("b")  # a alone (2600 tokens, 1 resident)
    assert [key for key in range(1, 7) if homes.transient(key)] == [2, 4]


def test_work_weighs_a_miss_as_its_computed_prompt_and_follows_a_prefix_that_moves() -> None:
    """Each request's work is the prompt tokens it computes plus its fixed cost (the default): a
    worker serving 6 hits brings less work than one serving 2 misses. A prefix that moves
    takes its work with it; a worker that leaves takes its prefixes'."""
    homes = recorded(PrefixHomes(horizon=10_000), ((1, "a", 6), (2, "b", 2)), misses=frozenset({2}))
    hit, miss = HIT + DEFAULT_OVERHEAD_TOKENS, PROMPT + DEFAULT_OVERHEAD_TOKENS
    total = 6 * hit + 2 * miss
    assert homes.work_shares() == {"a": pytest.approx(6 * hit / total, rel=5e-3),
                                   "b": pytest.approx(2 * miss / total, rel=5e-3)}
    assert homes.work_shares()["a"] < homes.work_shares()["b"] and homes.homed_share()["a"] > homes.homed_share()["b"]
    assert homes.work_share(2) == pytest.approx(2 * miss / total, rel=5e-3) and homes.work_share(99) is None
    assert snapshot_of(homes, 1).homed_work == homes.work_shares()
    homes.record(2, "c", PROMPT, computed=PROMPT)  # moved: its work (3 misses now) is c's
    assert homes.work_shares()["b"] == 0.0
    assert homes.work_shares()["c"] == pytest.approx(3 * miss / (total + miss), rel=5e-3)
    homes.forget("c")
    assert homes.work_shares() == {"a": pytest.approx(1.0, rel=5e-3), "b": 0.0}


def test_the_fixed_cost_of_a_request_is_configured() -> None:
    """With no fixed cost a miss weighs its computed prompt over a hit's (17 hits); with a
    large one, requests weigh nearly alike; a negative one is refused."""
    counts = ((1, "a", 6), (2, "b", 2))
    bare = recorded(PrefixHomes(horizon=10_000, overhead_tokens=0), counts, misses=frozenset({2}))
    assert bare.work_shares()["b"] == pytest.approx(2 * PROMPT / (6 * HIT + 2 * PROMPT), rel=5e-3)
    heavy = recorded(PrefixHomes(horizon=10_000, overhead_tokens=100_000), counts, misses=frozenset({2}))
    assert heavy.work_shares()["b"] == pytest.approx(0.25, abs=0.01)
    with pytest.raises(ValueError, match="overhead_tokens"):
        PrefixHomes(overhead_tokens=-1)


# 4 workers of 2560 tokens: 75% of the cluster's KV holds 7 prompts, the residents 1 to 7; a's
# prefixes draw the least traffic, with or without a few transients (none is overcommitted)
RESIDENTS = ((1, "b", 20), (2, "c", 19), (3, "d", 18), (4, "d", 17), (5, "b", 16), (6, "c", 15), (7, "a", 14))


TRANSIENTS = frozenset({8, 9, 10, 11})  # their requests miss


def test_a_transient_leaves_a_home_whose_work_is_more_than_twice_its_own_above_another() -> None:
    """a is home to three transients (4 misses each) beside its resident, c and d to residents
    only: a's prefixes bring more than twice prefix 8's share of the work above c's, though
    a draws the fewest requests. Its prompt, evicted, goes to c or d, the workers with no
    misses to compute. With prefix 8 and a less requested transient on a (less than twice
    its work apart from c), it stays: moving it would leave a lighter than its new home, and
    it would move back."""
    homes = sized(recorded(PrefixHomes(horizon=10_000), (*RESIDENTS, (8, "a", 4), (9, "a", 4), (10, "a", 4),
                                                         (11, "b", 4)), TRANSIENTS), "abcd")
    assert min(homes.homed_share(), key=homes.homed_share().__getitem__) == "a"
    assert [key for key in range(1, 12) if homes.transient(key)] == [8, 9, 10, 11]
    workers = [worker(name) for name in "abcd"]
    assert pick(workers, route(homes, 8)) in {"c", "d"}
    assert pick(workers, route(homes, 8), RoutingConfig(resident_homes=False)) == "a"

    balanced = sized(recorded(PrefixHomes(horizon=10_000), (*RESIDENTS, (9, "a", 3), (8, "a", 4), (11, "b", 4)),
                              TRANSIENTS), "abcd")
    assert pick(workers, route(balanced, 8)) == "a"


def test_a_resident_prefix_is_not_moved_for_the_transients_balance() -> None:
    """The transients' balance moves transients only: resident prefix 7, evicted from a whose
    prefixes bring far more work than anyone's, goes back to a."""
    homes = sized(recorded(PrefixHomes(horizon=10_000), (*RESIDENTS, (8, "a", 4), (9, "a", 4), (10, "a", 4)),
                           TRANSIENTS), "abcd")
    assert homes.resident(7) and not homes.transient(7)
    assert pick([worker(name) for name in "abcd"], route(homes, 7)) == "a"


def test_a_resident_stays_one_until_another_prefix_draws_half_as_much_again() -> None:
    """Room for one of two prompts: the resident (10 requests) stays one against 14, and gives
    way at 16 (over `RESIDENT_HOLD` x 10). Without incumbents the most requested wins."""
    assert RESIDENT_HOLD == 1.5
    budget = int(PROMPT / RESIDENT_FILL) + 1  # its `RESIDENT_FILL` holds one prompt
    assert rank_residents([(1, "a", 10.0, PROMPT), (2, "b", 14.0, PROMPT)], budget, {1})[0] == {1}
    assert rank_residents([(1, "a", 10.0, PROMPT), (2, "b", 16.0, PROMPT)], budget, {1})[0] == {2}
    assert rank_residents([(1, "a", 10.0, PROMPT), (2, "b", 14.0, PROMPT)], budget)[0] == {2}


def test_the_residents_hold_across_rankings_as_close_counts_wander() -> None:
    """Prefixes 1 and 2, of the same popularity, take turns being ahead; with room for one,
    the first ranked resident stays resident through every later ranking."""
    homes = sized(PrefixHomes(horizon=10_000), "a", kv_tokens=int(1.5 * PROMPT / RESIDENT_FILL))
    recorded(homes, ((1, "a", 3), (2, "a", 2), (3, "a", 2)))  # 3 live prompts: room for one
    assert homes.limited() and homes.resident(1)
    for turn in range(6):
        leader = 2 if turn % 2 == 0 else 1
        recorded(homes, ((leader, "a", RESIDENCY_EVERY // 2 + 2), (3 - leader, "a", RESIDENCY_EVERY // 2 - 2)))
        assert homes.resident(1) and not homes.resident(2), turn
