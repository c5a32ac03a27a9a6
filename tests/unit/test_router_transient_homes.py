"""Transient prefixes on plain data: past the cluster's KV, the recurring prefixes that are not
resident miss wherever they go (`routing.homes.PrefixHomes.transient`), so their homes share
out misses, and a home overloaded with them gives one up (`routing.candidates`)."""

from __future__ import annotations

import pytest

from services.router.routing.homes import PrefixHomes
from shared.config import RoutingConfig
from tests.unit.test_router_homes import PROMPT, pick, route, sized, worker


def recorded(homes: PrefixHomes, counts: tuple[tuple[int, str, int], ...]) -> PrefixHomes:
    for key, name, count in counts:
        for _ in range(count):
            homes.record(key, name, PROMPT)
    return homes


def test_recurring_prefixes_that_are_not_resident_are_transient_and_their_traffic_counts_per_home() -> None:
    """6 prompts on 2 workers of 2600 tokens: 75% of the cluster's KV holds 3 of them. Of the
    others, 4 and 5 recur (transient), 6 was seen once (not yet). Without a KV pool known,
    nothing is transient; a worker that leaves takes its transients' traffic with it."""
    counts = ((1, "a", 9), (2, "a", 8), (3, "b", 7), (4, "a", 2), (5, "b", 3), (6, "b", 1))
    unsized = recorded(PrefixHomes(horizon=10_000), counts)
    assert not unsized.limited() and unsized.transient_shares() == {} and not unsized.transient(4)
    homes = sized(recorded(PrefixHomes(horizon=10_000), counts), "ab", kv_tokens=2600)
    assert homes.limited()
    assert [key for key in range(1, 7) if homes.transient(key)] == [4, 5]
    assert not homes.transient(99)  # never seen
    shares = homes.transient_shares()
    assert shares.keys() == {"a", "b"}
    assert shares["a"] == pytest.approx(2 / 30, rel=5e-3) and shares["b"] == pytest.approx(3 / 30, rel=5e-3)
    assert homes.residents().transient_shares() == shares
    homes.forget("b")  # a alone (2600 tokens, 1 resident): prefix 2 is transient too
    assert homes.transient_shares() == {"a": pytest.approx(10 / 19, rel=5e-3)}


# 4 workers of 2560 tokens: 75% of the cluster's KV holds 7 prompts, the residents 1 to 7; a's
# prefixes draw the least traffic, with or without a few transients (none is overcommitted)
RESIDENTS = ((1, "b", 20), (2, "c", 19), (3, "d", 18), (4, "d", 17), (5, "b", 16), (6, "c", 15), (7, "a", 14))


def test_a_transient_leaves_a_home_whose_transients_draw_more_than_twice_its_share_above_another() -> None:
    """a is home to three transients (4 requests each), c and d to none: the transients on a
    draw 3 shares, c's none, more than twice prefix 8's share apart. Its prompt, evicted,
    goes to c or d, the workers with no transients' misses to compute. With prefix 8 and a
    less requested transient on a (less than twice its share apart), it stays: moving it
    would leave a with fewer transients' misses than its new home, and they would move back."""
    homes = sized(recorded(PrefixHomes(horizon=10_000), (*RESIDENTS, (8, "a", 4), (9, "a", 4), (10, "a", 4),
                                                         (11, "b", 4))), "abcd")
    assert [key for key in range(1, 12) if homes.transient(key)] == [8, 9, 10, 11]
    workers = [worker(name) for name in "abcd"]
    assert pick(workers, route(homes, 8)) in {"c", "d"}
    assert pick(workers, route(homes, 8), RoutingConfig(resident_homes=False)) == "a"

    balanced = sized(recorded(PrefixHomes(horizon=10_000), (*RESIDENTS, (9, "a", 3), (8, "a", 4), (11, "b", 4))),
                     "abcd")
    assert pick(workers, route(balanced, 8)) == "a"


def test_a_resident_prefix_is_not_moved_for_the_transients_balance() -> None:
    """The transients' balance moves transients only: resident prefix 7, evicted from a whose
    transients draw far more than anyone's, goes back to a."""
    homes = sized(recorded(PrefixHomes(horizon=10_000), (*RESIDENTS, (8, "a", 4), (9, "a", 4), (10, "a", 4))),
                  "abcd")
    assert homes.resident(7) and not homes.transient(7)
    assert pick([worker(name) for name in "abcd"], route(homes, 7)) == "a"
