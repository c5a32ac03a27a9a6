"""A worker's admin state machine: its role and status under control messages. Pure.

    ACTIVE <-> CORDONED          (Cordon / Uncordon)
    ACTIVE, CORDONED -> DRAINING (Drain; the worker leaves when its work and leases end)
    role: any -> any other       (SetRole, unless DRAINING: a leaving worker keeps its role)

Each applied change bumps `generation`, which goes into the registration so consumers
(the orchestrator waiting on a command) can tell the new registration from an older
heartbeat. Called by `admin.Admin` for `SetRole`, `Cordon`, `Uncordon` and `Drain`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shared.schemas import Cordon, Drain, SetRole, Uncordon, WorkerRole, WorkerStatus
from shared.schemas.control import ControlOutcome

AdminMessage = SetRole | Cordon | Uncordon | Drain


@dataclass(frozen=True, slots=True)
class AdminState:
    role: WorkerRole
    status: WorkerStatus = WorkerStatus.ACTIVE
    generation: int = 0


@dataclass(frozen=True, slots=True)
class Transition:
    outcome: ControlOutcome
    state: AdminState  # the state after the message (the old one unless applied)
    reason: str = ""


def apply(state: AdminState, message: AdminMessage) -> Transition:
    match message:
        case SetRole(role=role):
            if state.status is WorkerStatus.DRAINING:
                return Transition("refused", state, "the worker is draining")
            if role is state.role:
                return Transition("refused", state, f"the worker already serves as {role.value}")
            return _applied(state, role=role)
        case Cordon():
            return _set_status(state, WorkerStatus.CORDONED, "already cordoned")
        case Uncordon():
            return _set_status(state, WorkerStatus.ACTIVE, "not cordoned",
                               refused="the worker is draining: it is leaving")
        case Drain():
            return _set_status(state, WorkerStatus.DRAINING, "already draining")
    raise AssertionError(f"not an admin message: {message!r}")


def _set_status(state: AdminState, status: WorkerStatus, unchanged: str, *,
                refused: str = "the worker is draining") -> Transition:
    # DRAINING is final: a draining worker refuses every other status (Drain again is unchanged)
    if state.status is status:
        return Transition("unchanged", state, unchanged)
    if state.status is WorkerStatus.DRAINING:
        return Transition("refused", state, refused)
    return _applied(state, status=status)


def _applied(state: AdminState, **changes) -> Transition:
    return Transition("applied", replace(state, generation=state.generation + 1, **changes))
