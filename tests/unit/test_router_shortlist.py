"""A large fleet's shortlist on plain data (`routing.shortlist`): holders first, the home,
random draws for load; small fleets and `shortlist_workers=0` cost every worker."""

from __future__ import annotations

import collections
import random

import pytest

from services.router.config import RoutingConfig
from services.router.routing import RouteRequest
from services.router.routing.placement.snapshot import PrefixPlacement
from services.router.routing.shortlist import shortlist
from shared.config import ConfigError

FLEET = [f"w{index}" for index in range(1024)]
ROUTING = RoutingConfig(shortlist_workers=16)


def request(cached: dict[str, int] | None = None, home: str | None = None) -> RouteRequest:
    return RouteRequest(model="m", prompt_tokens=1000, total_tokens=1016, cached_tokens=cached or {},
                        held_tokens=cached or {}, prefix_key=1, placement=PrefixPlacement(home=home))


def test_a_small_fleet_or_shortlists_off_cost_every_worker() -> None:
    assert shortlist(FLEET[:16], request(), ROUTING, random.Random(0)) is None
    assert shortlist(FLEET, request(), RoutingConfig(shortlist_workers=0), random.Random(0)) is None


def test_the_shortlist_holds_the_holders_the_home_and_random_fill() -> None:
    ids = shortlist(FLEET, request({"w7": 512, "w900": 256}, home="w33"), ROUTING, random.Random(0))
    assert ids is not None and len(ids) == 16 and len(set(ids)) == 16
    assert ids[:3] == ["w7", "w900", "w33"]
    assert set(ids) <= set(FLEET)


def test_many_holders_keep_the_longest_half() -> None:
    cached = {worker_id: index for index, worker_id in enumerate(FLEET)}  # w1023 holds the most
    ids = shortlist(FLEET, request(cached), ROUTING, random.Random(0))
    assert ids is not None and len(ids) == 16
    assert ids[:8] == [f"w{index}" for index in range(1023, 1015, -1)]


def test_random_draws_reach_every_worker_over_many_requests() -> None:
    rng = random.Random(1)
    seen = collections.Counter(worker_id for _ in range(1000)
                               for worker_id in shortlist(FLEET, request(), ROUTING, rng) or ())
    assert len(seen) == len(FLEET)  # 16,000 draws over 1,024 workers: nobody left out
    assert max(seen.values()) < 5 * 16_000 / len(FLEET)


def test_a_shortlist_too_small_to_mean_anything_is_refused() -> None:
    with pytest.raises(ConfigError):
        RoutingConfig(shortlist_workers=2).validate()
