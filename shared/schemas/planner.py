"""The SLO planner's output on the wire: its actions and the decision event that carries them.

The orchestrator's planner (`services.orchestrator.planning`) returns these from its pure
`decide()`; the adapter publishes a `PlannerDecision` (dry run or not) and turns each action
into an orchestrator command. Every action carries a human reason.
"""

from __future__ import annotations

import msgspec

from shared.schemas.common import Message
from shared.schemas.membership import WorkerRole


class SwitchRole(msgspec.Struct, tag="switch_role", kw_only=True, frozen=True):
    """Move a running worker from one role to the other (cheap: no new process)."""

    worker_id: str
    from_role: WorkerRole
    to_role: WorkerRole
    reason: str


class ScaleUp(msgspec.Struct, tag="scale_up", kw_only=True, frozen=True):
    """Start one more worker of `role`."""

    role: WorkerRole
    reason: str


class ScaleDown(msgspec.Struct, tag="scale_down", kw_only=True, frozen=True):
    """Drain and stop `worker_id`."""

    worker_id: str
    role: WorkerRole
    reason: str


PlannerAction = SwitchRole | ScaleUp | ScaleDown


class PlannerDecision(Message, tag="planner_decision", kw_only=True):
    """One planner tick: what it decided and why (notes say what it chose not to do)."""

    ts: float
    actions: list[PlannerAction] = []
    notes: list[str] = []
    dry_run: bool = False  # set by the adapter: the actions were published, not carried out
    pressures: dict[str, float] = {}  # role -> its pressure this tick (1.0: at the SLO or at capacity)
