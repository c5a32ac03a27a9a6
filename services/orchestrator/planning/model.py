"""The planner's inputs, state and output (plain msgspec structs, no behaviour beyond checks).

Pressures are ratios: 1.0 means "at the SLO" (latency) or "at capacity" (utilisation).
"""

from __future__ import annotations

import msgspec

from shared.schemas.membership import WorkerRole
from shared.schemas.planner import PlannerAction


class Slos(msgspec.Struct, frozen=True, kw_only=True):
    ttft_p90_ms: float
    itl_p90_ms: float


class WorkerLoad(msgspec.Struct, frozen=True, kw_only=True):
    """One serving worker of a role; `load` ranks workers for scale-down (least loaded goes)."""

    worker_id: str
    load: float = 0.0  # prefill: queued prompt tokens; decode: running sequences


class RoleLoad(msgspec.Struct, frozen=True, kw_only=True):
    """What the cluster shows of one role over the last window."""

    workers: list[WorkerLoad]
    queue_time_p90_ms: float = 0.0
    ttft_p90_ms: float = 0.0  # prefill role: the requests' time to first token
    itl_p90_ms: float = 0.0  # decode role: inter-token latency
    prefill_demand_tok_s: float = 0.0  # prefill role: uncached prompt tokens arriving per second
    prefill_capacity_tok_s: float = 0.0  # prefill role: what its workers compute per second, all together
    decode_occupancy: float = 0.0  # decode role: running sequences / batch slots, 0..1
    kv_usage: float = 0.0  # used KV blocks / total, 0..1 (the fullest worker)

    @property
    def count(self) -> int:
        return len(self.workers)


class OperatorTouch(msgspec.Struct, frozen=True, kw_only=True):
    """A worker an operator command changed at `at` (role switch, drain, start)."""

    worker_id: str
    at: float
    command: str = ""


class ClusterSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    prefill: RoleLoad
    decode: RoleLoad
    operator_touches: list[OperatorTouch] = []
    operator_hold_until: float | None = None  # an operator said: no planner actions until then
    paused: str = ""  # an operation the planner must not interfere with ("a rolling upgrade is running"): no actions


class Budget(msgspec.Struct, frozen=True, kw_only=True):
    min_prefill: int = 1
    max_prefill: int = 8
    min_decode: int = 1
    max_decode: int = 8
    max_total: int = 8

    def role_min(self, role: WorkerRole) -> int:
        return self.min_prefill if role is WorkerRole.PREFILL else self.min_decode

    def role_max(self, role: WorkerRole) -> int:
        return self.max_prefill if role is WorkerRole.PREFILL else self.max_decode


class Thresholds(msgspec.Struct, frozen=True, kw_only=True):
    """Hysteresis: a role turns hot above `hot_enter` and stays hot until below `hot_exit`;
    it turns cold below `cold_enter` and stays cold until above `cold_exit`. An action needs
    its condition held for `sustain_s` without a break (a signal hovering at a threshold
    breaks it)."""

    hot_enter: float = 1.0
    hot_exit: float = 0.8
    cold_enter: float = 0.4
    cold_exit: float = 0.55
    sustain_s: float = 30.0
    occupancy_target: float = 0.9  # decode batch occupancy that counts as "at capacity"
    kv_target: float = 0.95


class PlannerConfig(msgspec.Struct, frozen=True, kw_only=True):
    budget: Budget = Budget()
    thresholds: Thresholds = Thresholds()
    global_cooldown_s: float = 60.0  # after any action, before the next
    worker_cooldown_s: float = 300.0  # after an action on a worker, before another on it
    operator_hold_s: float = 600.0  # the planner leaves an operator-touched worker alone this long
    # False: no launcher can start a worker (the orchestrator runs without one), so the planner
    # only switches roles: a worker it stopped could never come back when its role turns hot.
    can_add_workers: bool = True


class Trend(msgspec.Struct, frozen=True, kw_only=True):
    """One (role, direction) condition. `active` follows the hysteresis (enter/exit);
    `held_since` is when the signal last went beyond the enter threshold and stayed there on
    every sample since (None: the last sample was not beyond it). An action needs both."""

    active: bool = False
    held_since: float | None = None


class PlannerState(msgspec.Struct, frozen=True, kw_only=True):
    last_action_at: float | None = None
    worker_last_action: dict[str, float] = {}
    trends: dict[str, Trend] = {}  # "prefill.hot", "prefill.cold", "decode.hot", "decode.cold"


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    actions: list[PlannerAction]
    notes: list[str]
    state: PlannerState
    pressures: dict[str, float] = {}  # role -> pressure this tick (for the event and debugging)
