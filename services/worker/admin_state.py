"""A worker's admin state machine: its role and status under control messages. Pure.

    ACTIVE <-> CORDONED          (Cordon / Uncordon)
    ACTIVE, CORDONED -> DRAINING (Drain; the worker leaves when its work and leases end)
    role: any -> any other       (SetRole, unless DRAINING: a leaving worker keeps its role)

Each applied change bumps `generation`, which goes into the registration so consumers
(the orchestrator waiting on a command) can tell the new registration from an older
heartbeat. Called by `WorkerService` for `SetRole`, `Cordon`, `Uncordon` and `Drain`.
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
            if state.status is WorkerStatus.DRAINING:
                return Transition("refused", state, "the worker is draining")
            if state.status is WorkerStatus.CORDONED:
                return Transition("unchanged", state, "already cordoned")
            return _applied(state, status=WorkerStatus.CORDONED)
        case Uncordon():
            if state.status is WorkerStatus.DRAINING:
                return Transition("refused", state, "the worker is draining: it is leaving")
            if state.status is WorkerStatus.ACTIVE:
                return Transition("unchanged", state, "not cordoned")
            return _applied(state, status=WorkerStatus.ACTIVE)
        case Drain():
            if state.status is WorkerStatus.DRAINING:
                return Transition("unchanged", state, "already draining")
            return _applied(state, status=WorkerStatus.DRAINING)
    raise AssertionError(f"not an admin message: {message!r}")


def _applied(state: AdminState, **changes) -> Transition:
    return Transition("applied", replace(state, generation=state.generation + 1, **changes))
