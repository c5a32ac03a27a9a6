"""The sweep's arms: which system serves, with which router settings, and how each request is
routed by the client (only the oracle arm does: it pins requests to workers with a header).

`ARMS` is the one place that maps an arm name to its settings: Tandem's router settings
(rendered as `tandem router` flags by the local launcher: `{"prefix_pull": False}` ->
`--no-prefix-pull`), or, for an external system, whatever its launcher reads. A calibrated
kv-aware cost model goes into `kv_aware_settings`. `Pinning` is the oracle arm's per-request
side: it asks `bench.routing.oracle.Oracle` for a worker, sends `X-Tandem-Worker: <id>` (the
router's `pinned` policy serves the request there) and counts the client's outstanding
requests per worker. `NoPinning` is every other arm's. Called by `bench.routing.sweep` and
`bench.routing.sweep_drive`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from bench.routing.oracle import Oracle
from bench.routing.workloads import EngineShape
from services.router.routing.calibration import host_load_weight

PIN_HEADER = "X-Tandem-Worker"
LEARN_PER_GROUP = 4  # oracle-learned: requests per tenant counted before it places them by share


def kv_aware_settings(shape: EngineShape) -> dict:
    """Tandem's kv-aware router settings for workers of `shape` (calibrated weights go here):
    a host-tier hit's load weighed by the sim profile's own load and prefill times."""
    profile = shape.profile
    return {"routing_policy": "kv-aware",
            "host_load_weight": host_load_weight(profile.prefill_ms_per_token, profile.host_load_ms)}


@dataclass(frozen=True)
class Arm:
    name: str
    system: str  # which launcher starts it: "tandem" (a LocalStack), or an external system's name
    settings: dict = field(default_factory=dict)  # the system's router settings
    oracle: bool = False  # the client pins every request to the oracle's pick
    learn_per_group: int = 0  # > 0: the oracle learns the shares from this many requests per group first
    baseline: str = ""  # the arm this one's gain is measured against (its own system's plain baseline)


def arms(shape: EngineShape, kv_overrides: Mapping[str, object] | None = None) -> dict[str, Arm]:
    """Every arm by name; `kv_overrides`: router settings that replace kv-aware's (a weight to
    try, e.g. {"queue_weight": 1.0}). Dynamo's arms need its launcher (`systems.LAUNCHERS`)."""
    return {arm.name: arm for arm in (
        Arm("kv-aware", "tandem", {**kv_aware_settings(shape), **(kv_overrides or {})}, baseline="round-robin-plain"),
        # kv-aware without bounded affinity and cold victims: what those two add (an ablation)
        Arm("kv-aware-greedy", "tandem", {**kv_aware_settings(shape), **(kv_overrides or {}),
                                          "bounded_affinity": False, "cold_victims": False},
            baseline="round-robin-plain"),
        # kv-aware with an index that knows one KV tier: a block outside it counts as gone
        Arm("kv-tier-blind", "tandem", {**kv_aware_settings(shape), **(kv_overrides or {}), "kv_tier_aware": False},
            baseline="kv-aware"),
        Arm("round-robin-plain", "tandem", {"routing_policy": "round-robin", "prefix_pull": False}),
        Arm("round-robin-pull", "tandem", {"routing_policy": "round-robin"}, baseline="round-robin-plain"),
        Arm("oracle", "tandem", {"routing_policy": "pinned"}, oracle=True, baseline="round-robin-plain"),
        # the oracle without foreknowledge of the popularity: what learning it costs (a reference)
        Arm("oracle-learned", "tandem", {"routing_policy": "pinned"}, oracle=True,
            learn_per_group=LEARN_PER_GROUP, baseline="round-robin-plain"),
        Arm("dynamo-kv", "dynamo", {"router_mode": "kv"}, baseline="dynamo-round-robin"),
        Arm("dynamo-round-robin", "dynamo", {"router_mode": "round-robin"}),
    )}


DEFAULT_ARMS = ("kv-aware", "round-robin-plain", "round-robin-pull", "oracle")


def rotated(names: list[str], point_index: int) -> list[str]:
    """The arm order for the `point_index`-th point: rotated by one per point, so no arm always
    runs first (or last) on a machine whose speed drifts."""
    if not names:
        return []
    shift = point_index % len(names)
    return names[shift:] + names[:shift]


class RequestRouting(Protocol):
    """The client's side of routing one request: headers to send, and the count it keeps."""

    def begin(self, group: str | None) -> tuple[dict[str, str], str | None]: ...

    def end(self, worker: str | None) -> None: ...

    def session_ended(self, group: str | None) -> None: ...


class NoPinning:
    def begin(self, group: str | None) -> tuple[dict[str, str], str | None]:
        return {}, None

    def end(self, worker: str | None) -> None:
        pass

    def session_ended(self, group: str | None) -> None:
        pass


class Pinning:
    """The oracle arm's client side: pin each request to the oracle's worker for its group."""

    def __init__(self, oracle: Oracle) -> None:
        self.oracle = oracle
        self.outstanding: Counter[str] = Counter()
        self.sent: Counter[str] = Counter()  # requests per worker, for the row's imbalance figure

    def begin(self, group: str | None) -> tuple[dict[str, str], str | None]:
        worker = self.oracle.pick(group, self.outstanding)
        self.outstanding[worker] += 1
        self.sent[worker] += 1
        return {PIN_HEADER: worker}, worker

    def end(self, worker: str | None) -> None:
        if worker is not None:
            self.outstanding[worker] -= 1

    def session_ended(self, group: str | None) -> None:
        if group is not None:
            self.oracle.release(group)
