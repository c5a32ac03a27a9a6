"""The SLO planner as pure policy: `decide(snapshot, slos, state, now) -> Decision`.

Called by the orchestrator's planner adapter (not part of this package) once per tick with a
`ClusterSnapshot` it built from the cluster-state library (`shared.cluster`) and the
router's latency figures. `decide` is synchronous, reads no clock and does no I/O: it returns
the actions (`shared.schemas.planner`) with their reasons, notes on what it chose not to do,
and the next `PlannerState`. Dry run is the adapter's concern: `decide` always says what it
would do.

- `model`: inputs (snapshot, SLOs, budget, thresholds), state and the decision;
- `signals`: per-role pressures and their hysteresis/sustain tracking;
- `policy`: `decide`;
- `whatif`: the what-if model's contract (a capacity simulator, e.g. `bench.plan`'s, is
  injected by the composition root: the orchestrator imports no other service).
"""

from services.orchestrator.planning.model import (
    Budget,
    ClusterSnapshot,
    Decision,
    OperatorTouch,
    PlannerConfig,
    PlannerState,
    RoleLoad,
    Slos,
    Thresholds,
    WorkerLoad,
)
from services.orchestrator.planning.policy import decide

__all__ = ["Budget", "ClusterSnapshot", "Decision", "OperatorTouch", "PlannerConfig", "PlannerState", "RoleLoad",
           "Slos", "Thresholds", "WorkerLoad", "decide"]
