"""Waking a scalable model (adapter): the orchestrator's answer to a router's `WakeModel`.

`ControlPlane.execute` hands a `WakeModel` here. A model declared `NAME=DIR` wakes as one
worker of role both; one declared `NAME=DIR@<P>p<D>d` (`shared.scalable_models`) as P prefill
and D decode workers, started together through the launcher (`WorkerCommands.add`, each given
the model's directory and name: `launchers.worker_command.model_flags`). Only the workers the
model lacks are started: an active prefill worker counts for a prefill one, an active decode or
both worker for a decode one.
The outcome is `ok` once every started worker registered ACTIVE, so a disaggregated model can
then be served disaggregated; if any start fails, the others of that wake are drained and
stopped again (`WorkerCommands.remove`) and the outcome is `failed` with each one's reason.
Concurrent wakes of one model share one start. The control plane is reached through
`worker_commands.WorkerCommands` (it hands itself in), the limits through the orchestrator's config.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections import Counter
from collections.abc import Mapping

from services.orchestrator.command_checks import refusal, serves
from services.orchestrator.config import OrchestratorConfig
from services.orchestrator.launchers.worker_command import model_flags
from services.orchestrator.worker_commands import WorkerCommands
from shared.scalable_models import ScalableModel
from shared.schemas import WorkerRegistration, WorkerRole, WorkerStatus
from shared.schemas.orchestrator import AddWorker, CommandOutcome, WorkerSummary


def missing_roles(model: ScalableModel, members: Mapping[str, WorkerRegistration]) -> list[WorkerRole]:
    """The roles of the workers a wake of `model` starts (one entry per worker); none when
    its active workers already serve it as declared."""
    active = Counter(WorkerRole.PREFILL if registration.role is WorkerRole.PREFILL else WorkerRole.DECODE
                     for registration in members.values()
                     if registration.model == model.name and registration.status is WorkerStatus.ACTIVE
                     and (serves(registration.role) or registration.role is WorkerRole.PREFILL))
    if not model.disaggregated:
        return [] if active[WorkerRole.DECODE] else [WorkerRole.BOTH]
    return [WorkerRole.PREFILL] * max(0, model.prefill_workers - active[WorkerRole.PREFILL]) + \
        [WorkerRole.DECODE] * max(0, model.decode_workers - active[WorkerRole.DECODE])


class ModelWakes:
    def __init__(self, control: WorkerCommands, config: OrchestratorConfig) -> None:
        self._control = control
        self._config = config
        self._models = dict(config.scale_to_zero.scalable())
        self._starting: dict[str, asyncio.Future[CommandOutcome]] = {}  # a model's start under way

    async def wake(self, name: str) -> CommandOutcome:
        model = self._models.get(name)
        if model is None:
            return CommandOutcome(outcome="refused", reason=f"model {name!r} is not one this orchestrator starts "
                                                            f"(--scalable-model)")
        starting = self._starting.get(name)
        if starting is None:
            members = self._control.members()
            roles = missing_roles(model, members)
            if not roles:
                serving = sorted(worker_id for worker_id, registration in members.items()
                                 if registration.model == name and registration.status is WorkerStatus.ACTIVE)
                has = "active prefill and decode workers" if model.disaggregated else "an active worker"
                return self._control.done(serving[0], f"model {name} has {has}")
            why = self._over_budget(roles, members)
            if why is not None:
                return CommandOutcome(outcome="refused", reason=f"model {name}: {why}")
            starting = self._starting[name] = asyncio.ensure_future(self._start(model, roles))
            starting.add_done_callback(lambda _: self._starting.pop(name, None))
        return await asyncio.shield(starting)  # one waker cancelled leaves the start to the others

    def _over_budget(self, roles: list[WorkerRole], members: Mapping[str, WorkerRegistration]) -> str | None:
        """Why the limits refuse starting these workers together (`execute` checked one already)."""
        config = self._config
        if config.limits.max_workers and len(members) + len(roles) > config.limits.max_workers:
            return f"{len(roles)} more workers would pass the cluster's budget of {config.limits.max_workers}"
        for role in set(roles):
            why = refusal(AddWorker(role=role), members, config.limits, can_launch=config.launcher.kind != "none")
            if why is not None:
                return why
        return None

    async def _start(self, model: ScalableModel, roles: list[WorkerRole]) -> CommandOutcome:
        prefix = re.sub(r"[^A-Za-z0-9_-]", "-", model.name)[:40]
        args = model_flags(model.directory, model.name)
        starts = [AddWorker(role=role, worker_id=f"{prefix}-{uuid.uuid4().hex[:8]}" if role is WorkerRole.BOTH
                            else f"{prefix}-{role.value}-{uuid.uuid4().hex[:8]}") for role in roles]
        outcomes = await asyncio.gather(*(self._control.add(start, args) for start in starts))
        if len(outcomes) == 1:
            return outcomes[0]
        started = [outcome for outcome in outcomes if outcome.ok]
        if len(started) == len(outcomes):
            workers = [summary for outcome in outcomes for summary in outcome.workers]
            return CommandOutcome(outcome="ok", worker_id=outcomes[0].worker_id, workers=workers,
                                  reason=f"started and registered {_roles(workers)}")
        return await self._undo(model, outcomes, started)

    async def _undo(self, model: ScalableModel, outcomes: list[CommandOutcome],
                    started: list[CommandOutcome]) -> CommandOutcome:
        """A start failed: the workers that did start are drained and stopped (nothing is left)."""
        deadline_s = self._config.scale_to_zero.drain_deadline_s
        removed = await asyncio.gather(*(self._control.remove(outcome.worker_id, deadline_s) for outcome in started))
        failures = [f"worker {outcome.worker_id}: {outcome.reason}" for outcome in outcomes if not outcome.ok]
        stopped = [f"{outcome.worker_id} ({outcome.outcome})" for outcome in removed]
        kind = "failed" if any(outcome.outcome == "failed" for outcome in outcomes) else "refused"
        reason = f"model {model.name} could not start all its workers; " + "; ".join(failures)
        if stopped:
            reason += f"; stopped again: {', '.join(stopped)}"
        return CommandOutcome(outcome=kind, worker_id=next(o.worker_id for o in outcomes if not o.ok), reason=reason)


def _roles(workers: list[WorkerSummary]) -> str:
    return ", ".join(f"{summary.registration.worker_id} ({summary.registration.role.value})" for summary in workers)
