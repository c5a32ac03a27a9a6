"""A worker's admin state machine (services/worker/admin_state.py), with plain data."""

from __future__ import annotations

import pytest

from services.worker.admin_state import AdminState, apply
from shared.schemas import Cordon, Drain, SetRole, Uncordon, WorkerRole, WorkerStatus

ACTIVE, CORDONED, DRAINING = WorkerStatus.ACTIVE, WorkerStatus.CORDONED, WorkerStatus.DRAINING


def test_role_switch_bumps_the_generation_and_keeps_the_status() -> None:
    state = AdminState(role=WorkerRole.PREFILL, status=CORDONED, generation=3)
    transition = apply(state, SetRole(role=WorkerRole.DECODE))
    assert transition.outcome == "applied"
    assert transition.state == AdminState(role=WorkerRole.DECODE, status=CORDONED, generation=4)


def test_switch_to_the_same_role_is_refused() -> None:
    state = AdminState(role=WorkerRole.DECODE)
    transition = apply(state, SetRole(role=WorkerRole.DECODE))
    assert transition.outcome == "refused" and "already" in transition.reason
    assert transition.state is state


@pytest.mark.parametrize("message", [SetRole(role=WorkerRole.BOTH), Cordon(), Uncordon()])
def test_a_draining_worker_refuses_admin_changes(message) -> None:
    state = AdminState(role=WorkerRole.PREFILL, status=DRAINING, generation=1)
    transition = apply(state, message)
    assert transition.outcome == "refused" and transition.state is state


def test_cordon_uncordon_round_trip() -> None:
    state = AdminState(role=WorkerRole.BOTH)
    cordoned = apply(state, Cordon())
    assert (cordoned.outcome, cordoned.state.status, cordoned.state.generation) == ("applied", CORDONED, 1)
    assert apply(cordoned.state, Cordon()).outcome == "unchanged"
    active = apply(cordoned.state, Uncordon())
    assert (active.outcome, active.state.status, active.state.generation) == ("applied", ACTIVE, 2)
    assert apply(active.state, Uncordon()).outcome == "unchanged"


@pytest.mark.parametrize("status", [ACTIVE, CORDONED])
def test_drain_from_active_or_cordoned_then_again_is_unchanged(status: WorkerStatus) -> None:
    draining = apply(AdminState(role=WorkerRole.PREFILL, status=status), Drain())
    assert draining.outcome == "applied" and draining.state.status is DRAINING
    assert apply(draining.state, Drain()).outcome == "unchanged"
