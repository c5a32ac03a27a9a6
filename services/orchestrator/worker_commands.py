"""What the orchestrator's longer commands ask of the control plane (`WorkerCommands`).

The wake of a scalable model (`model_wake.ModelWakes`) and the rolling upgrade
(`rolling_upgrade`) carry out their steps as the control plane's own commands: add a worker
and wait until it registered, remove one (drain, then stop), cordon or uncordon one, read the
members, publish progress. `control_plane.ControlPlane` implements this protocol and hands
itself to them; they name the protocol, not the control plane, so the module that runs them
is not one they import (no circle, and a test can hand them a fake).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import msgspec

from shared.schemas import WorkerRegistration
from shared.schemas.orchestrator import AddWorker, CommandOutcome, OrchestratorCommand, WorkerSummary


class WorkerCommands(Protocol):
    def members(self) -> Mapping[str, WorkerRegistration]:
        """The members bucket as the orchestrator mirrors it, by worker id."""
        ...

    def summaries(self) -> list[WorkerSummary]:
        """Every member, in worker-id order, and whether this orchestrator started it."""
        ...

    def done(self, worker_id: str, reason: str) -> CommandOutcome:
        """An `ok` outcome for `worker_id`, with its summary if it is a member."""
        ...

    async def execute(self, command: OrchestratorCommand) -> CommandOutcome:
        """One command, checked and carried out to its end (the command subject's path)."""
        ...

    async def add(self, command: AddWorker, extra_args: tuple[str, ...] = ()) -> CommandOutcome:
        """Start a worker through the launcher (`extra_args` last); `ok` once it registered ACTIVE."""
        ...

    async def remove(self, worker_id: str, deadline_s: float) -> CommandOutcome:
        """Drain the worker, then stop its process if this orchestrator started it."""
        ...

    async def publish(self, subject: str, message: msgspec.Struct) -> None:
        """A courtesy message (progress); never raises."""
        ...
