"""The prefixes' placement as the routing state holds it (`routing.placement.placement`): one
`Placement` per model following membership, a frozen snapshot per request, and the plans
recorded once committed."""

from __future__ import annotations

import pytest

from services.router.config import RoutingConfig
from services.router.routing import RoutePlan, RouteRequest
from services.router.routing.placement.placement import Placements

CHAIN_TOKENS = 1024  # the prompt's tokens in full blocks


def request(placements: Placements, cached: dict[str, int] | None = None, key: int = 100) -> RouteRequest:
    return RouteRequest(model="m", prompt_tokens=CHAIN_TOKENS, total_tokens=CHAIN_TOKENS + 16,
                        cached_tokens=cached or {}, held_tokens=cached or {}, prefix_key=key,
                        block_tokens=CHAIN_TOKENS, placement=placements.model("m").snapshot(key))


def committed(placements: Placements, worker_id: str, cached: dict[str, int] | None = None, *,
              moves_home: bool = False) -> None:
    placements.model("m").record(request(placements, cached), RoutePlan("single", "single_cheaper", worker_id,
                                                                        moves_home=moves_home))


def test_a_prefix_sent_to_leave_its_home_moves_there_though_the_home_still_holds_it() -> None:
    """w1 holds the prompt and is its home: a request served by w2 is a copy (the home stays)
    unless the routing sent it there to leave w1 (`moves_home`); then w2 is the home."""
    placements = Placements(RoutingConfig())
    for worker_id in ("w1", "w2"):
        placements.worker_joined(worker_id, 16, kv_tokens=4096, model="m")
    committed(placements, "w1")
    assert placements.model("m").snapshot(100).home == "w1"
    committed(placements, "w2", {"w1": CHAIN_TOKENS})
    assert placements.model("m").snapshot(100).home == "w1"
    committed(placements, "w2", {"w1": CHAIN_TOKENS}, moves_home=True)
    assert placements.model("m").snapshot(100).home == "w2"


def test_the_members_kv_pools_bound_the_resident_prefixes() -> None:
    """Two recurring prompts of 1500 tokens on a member of 2000: past the cluster's KV. Once
    the member leaves, its pool and its prefixes go with it."""
    placements = Placements(RoutingConfig())
    placements.worker_joined("w1", 16, kv_tokens=2000, model="m")
    placement = placements.model("m")
    for _ in range(3):
        placement.routed_elsewhere(1, "w1", 1500)
        placement.routed_elsewhere(2, "w1", 1500)
    snapshot = placement.snapshot(1)
    assert snapshot.limited and snapshot.homed_tokens["w1"] == 1500
    placements.worker_left("w1")
    snapshot = placements.model("m").snapshot(1)
    assert not snapshot.limited and snapshot.home is None and snapshot.homed_tokens.get("w1", 0) == 0


def test_homes_stay_in_their_models_placement() -> None:
    placements = Placements(RoutingConfig())
    placements.worker_joined("a1", 16, model="model-a")
    placements.worker_joined("b1", 16, model="model-b")
    placements.of_worker("a1").routed_elsewhere(7, "a1", 64)  # type: ignore[union-attr]
    assert placements.model("model-a").snapshot(7).home == "a1"
    assert placements.model("model-b").snapshot(7).home is None
    placements.worker_joined("a1", 16, model="model-b")  # now serving model B: its homes in A are gone
    assert placements.of_worker("a1") is placements.model("model-b")
    assert placements.model("model-a").snapshot(7).home is None


def test_a_snapshot_read_after_the_placement_changed_is_a_bug() -> None:
    """The snapshot's figures are computed on first read, as of when it was taken: read after
    another request was recorded, it would not be the placement the routing saw."""
    placements = Placements(RoutingConfig())
    placements.worker_joined("w1", 16, kv_tokens=4096, model="m")
    before = request(placements)
    assert before.placement.home is None and before.placement.homed_share.get("w1", 0.0) == 0.0
    placements.model("m").record(before, RoutePlan("single", "single_cheaper", "w1"))
    assert before.placement.home is None  # taken before the record: frozen
    with pytest.raises(AssertionError):
        before.placement.homed_tokens.get("w1")
    assert request(placements).placement.homed_tokens["w1"] == CHAIN_TOKENS
