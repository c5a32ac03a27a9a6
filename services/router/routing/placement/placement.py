"""Prefix placement, one object per served model: `Placement`, and `Placements`, one per
model as its workers join and leave. Pure.

The routing state holds the `Placements` (the worker pool tells them of membership, as it
tells the KV view). Per request, `Placement.snapshot` gives the read-only view of the prompt's
prefix that goes into its `RouteRequest` (`snapshot.PrefixPlacement`: its home, the shares,
its residency, the workers' homed tokens); routing decides with it (the home rules,
`rules.HomeRules`); once the routing state has committed the plan, `Placement.record`
counts the request at its computing worker (its home now, or a copy's), and
`routed_elsewhere` a prompt that another router routed.

Callers: `services.router.flows.routing_state.RoutingState` (`snapshot`, `record`) and
`RoutedPrompts.peer_routed` (`routed_elsewhere`).
"""

from __future__ import annotations

from services.router.routing.by_model import ByModel
from services.router.routing.config import RoutingConfig
from services.router.routing.placement.homes import PrefixHomes
from services.router.routing.placement.snapshot import PrefixPlacement, snapshot_of
from services.router.routing.plan import RoutePlan
from services.router.routing.request import RouteRequest


class Placement:
    """One model's prefix homes (`homes.PrefixHomes`), read per request and fed the plans."""

    def __init__(self, routing: RoutingConfig) -> None:
        self.homes = PrefixHomes(overhead_tokens=routing.request_overhead_tokens)
        self._resident_homes = routing.resident_homes  # homed tokens count the resident prefixes only
        self._workers: set[str] = set()

    def snapshot(self, prefix_key: int | None) -> PrefixPlacement:
        """What routing reads of the prefix `prefix_key` (None: a prompt shorter than a block)
        as of now."""
        return snapshot_of(self.homes, prefix_key, resident_homes=self._resident_homes)

    def record(self, request: RouteRequest, plan: RoutePlan) -> None:
        """The dispatcher committed `plan` for `request`: its prefix's home is now the computing
        worker, unless the home still holds most of the prompt (then the worker got a copy,
        `PrefixHomes.record`) and the prefix was not sent there to leave it (`plan.moves_home`)."""
        prefix_key = request.prefix_key
        if prefix_key is None:
            return
        worker_id, cached = plan.computing_worker_id, request.cached_tokens
        home = self.homes.home(prefix_key)
        copy = (not plan.moves_home and home is not None and home != worker_id
                and 2 * cached.get(home, 0) >= request.block_tokens)
        computed = max(0, request.block_tokens - cached.get(worker_id, 0))
        self.homes.record(prefix_key, worker_id, request.block_tokens, computed=computed, copy=copy)

    def routed_elsewhere(self, prefix_key: int | None, worker_id: str, block_tokens: int) -> None:
        """Another router routed a prompt of `block_tokens` in full blocks with this prefix to
        `worker_id`: its home now, its prompt computed there (this router knows no more)."""
        if prefix_key is not None:
            self.homes.record(prefix_key, worker_id, block_tokens, computed=block_tokens)

    @property
    def worker_ids(self) -> list[str]:
        return list(self._workers)

    def worker_joined(self, worker_id: str, kv_tokens: int) -> None:
        """`kv_tokens`: its KV pool (0: unknown), which bounds the prefixes it keeps resident."""
        self._workers.add(worker_id)
        self.homes.set_capacity(worker_id, kv_tokens)

    def worker_left(self, worker_id: str) -> None:
        self._workers.discard(worker_id)
        self.homes.forget(worker_id)


class Placements:
    """A `Placement` per served model, following membership (a `fleet.worker_pool`
    `MembershipListener`): a prefix key of one model never names a home among another
    model's workers."""

    def __init__(self, routing: RoutingConfig) -> None:
        self._models: ByModel[Placement] = ByModel(lambda: Placement(routing))

    def model(self, model: str) -> Placement:
        """`model`'s placement (empty until its workers join)."""
        return self._models.part(model)

    def of_worker(self, worker_id: str) -> Placement | None:
        """The placement of `worker_id`'s model; None for a worker not (or no longer) a member."""
        return self._models.of_worker(worker_id)

    def worker_joined(self, worker_id: str, block_size: int, kv_tokens: int = 0, *, model: str,
                      lends_host_tier: bool = False) -> None:
        """`kv_tokens`: its KV pool (0: unknown); `block_size` and `lends_host_tier` are the KV
        view's business."""
        self._models.join(worker_id, model).worker_joined(worker_id, kv_tokens)

    def worker_left(self, worker_id: str) -> None:
        self._models.leave(worker_id)
