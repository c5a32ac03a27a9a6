"""The rolling upgrade (adapter): an `UpgradeWorkers` command carried out step by step.

The plan comes from `upgrade_plan.plan_upgrade` (pure) over the members bucket as the
orchestrator mirrors it. Then, in order:

- the add steps of a round start their workers together through the launcher, with the
  command's flags and `--model-version <version>` last (so they win over the launcher's);
  each is waited on until it registered ACTIVE (`WorkerCommands.add`);
- a wait step checks that every new worker of the round is ACTIVE and registered the new
  version (a worker whose flags did not change its version fails the upgrade);
- a cordon step cordons the round's old pair together (`CordonWorker`, checked like the
  command);
- a drain step drains its old workers together and stops the processes the orchestrator
  started (`WorkerCommands.remove`): the prefill worker first, then the decode one.

Each step, as it ends, is published on `orchestrator.progress` (`CommandProgress`) and
logged. The first step that fails ends the upgrade: if its round drained nothing yet, the old
workers it cordoned are uncordoned and its new workers removed again (the cluster is as
it was at the round's start), and the outcome is `failed` with the steps done and why. `ok` carries every step
and the workers at the end.

The control plane runs it and hands itself in as `worker_commands.WorkerCommands`, with the
orchestrator's config (the limits the plan keeps to, the progress subject).
"""

from __future__ import annotations

import asyncio
import logging
import weakref

from services.orchestrator.config import OrchestratorConfig
from services.orchestrator.upgrade_plan import (
    AddStep,
    CordonStep,
    CurrentWorker,
    DrainStep,
    UpgradePlan,
    UpgradeStep,
    WaitActiveStep,
    plan_upgrade,
)
from services.orchestrator.worker_commands import WorkerCommands
from shared.schemas import WorkerRole, WorkerStatus
from shared.schemas.orchestrator import (
    AddWorker,
    CommandOutcome,
    CommandProgress,
    CordonWorker,
    UncordonWorker,
    UpgradeWorkers,
)

log = logging.getLogger(__name__)


class StepFailed(Exception):
    """A step did not finish (an expected failure: the upgrade answers `failed`)."""


# The control planes running an upgrade: a second one is refused while the first runs (its
# plan would count the first one's new workers as the cluster's).
_upgrading: weakref.WeakSet[WorkerCommands] = weakref.WeakSet()


def upgrade_running(control: WorkerCommands) -> bool:
    """Whether `control` is carrying out a rolling upgrade now (the planner takes no action meanwhile)."""
    return control in _upgrading


async def rolling_upgrade(control: WorkerCommands, config: OrchestratorConfig,
                          command: UpgradeWorkers) -> CommandOutcome:
    if control in _upgrading:
        return CommandOutcome(outcome="refused", reason="an upgrade is already running")
    _upgrading.add(control)
    try:
        return await _upgrade(control, config, command)
    finally:
        _upgrading.discard(control)


async def _upgrade(control: WorkerCommands, config: OrchestratorConfig, command: UpgradeWorkers) -> CommandOutcome:
    try:
        role_args = {WorkerRole(role): tuple(args) for role, args in command.role_args.items()}
    except ValueError as error:
        return CommandOutcome(outcome="refused", reason=f"role settings: {error}")
    current = [CurrentWorker(worker_id=r.worker_id, role=r.role, model=r.model, version=r.model_version,
                             compat_hash=r.compat_hash, status=r.status)
               for _, r in sorted(control.members().items())]
    plan = plan_upgrade(current, command.model_version, config.limits, model=command.model)
    if isinstance(plan, str):
        return CommandOutcome(outcome="refused", reason=plan)
    if not plan.steps:
        return CommandOutcome(outcome="ok", reason=f"every worker is at version {command.model_version} already",
                              workers=control.summaries())
    log.info("upgrade of %s to %s: %d steps, up to %d extra worker(s)", plan.model, plan.version,
             len(plan.steps), plan.extra_workers)
    return await _Run(control, config.bus.subjects.orchestrator_progress, command, plan, role_args).run()


class _Run:
    def __init__(self, control: WorkerCommands, progress_subject: str, command: UpgradeWorkers, plan: UpgradePlan,
                 role_args: dict[WorkerRole, tuple[str, ...]]) -> None:
        self._control = control
        self._progress_subject = progress_subject
        self._command = command
        self._plan = plan
        self._role_args = role_args
        self._done: list[str] = []
        self._unpaired: list[str] = []  # new workers started in the current round
        self._cordoned: list[str] = []  # old workers cordoned in the current round, none drained yet

    async def run(self) -> CommandOutcome:
        steps = self._plan.steps
        index = 0
        while index < len(steps):
            # the add steps of a round run together
            batch: list[UpgradeStep] = [steps[index]]
            while isinstance(batch[0], AddStep) and index + len(batch) < len(steps) \
                    and isinstance(steps[index + len(batch)], AddStep):
                batch.append(steps[index + len(batch)])
            try:
                await self._carry_out(batch, index)
            except StepFailed as error:
                await self._undo_round()
                done = "; ".join(self._done) or "nothing"
                return CommandOutcome(outcome="failed", steps=list(self._done), workers=self._control.summaries(),
                                      reason=f"upgrade to {self._plan.version} stopped: {error} (done: {done})")
            index += len(batch)
        return CommandOutcome(outcome="ok", steps=list(self._done), workers=self._control.summaries(),
                              reason=f"{self._plan.model} upgraded to {self._plan.version} in {len(steps)} steps")

    async def _carry_out(self, batch: list[UpgradeStep], index: int) -> None:
        """The steps of `batch` (one step, or a round's add steps together); raises
        `StepFailed` if any of them failed."""
        match batch[0]:
            case AddStep():
                results = await asyncio.gather(*(self._add(step) for step in batch if isinstance(step, AddStep)))
            case WaitActiveStep() as step:
                results = [self._check_active(step)]
            case CordonStep() as step:
                self._cordoned = list(step.worker_ids)
                outcomes = await asyncio.gather(*(self._control.execute(CordonWorker(worker_id=worker_id))
                                                  for worker_id in step.worker_ids))
                results = ["; ".join(outcome.reason for outcome in outcomes if not outcome.ok)]
            case DrainStep() as step:
                outcomes = await asyncio.gather(*(self._control.remove(worker_id, self._command.deadline_s)
                                                  for worker_id in step.worker_ids))
                self._unpaired.clear()  # their old pair is going: the new ones stay whatever happens
                self._cordoned.clear()
                results = ["; ".join(outcome.reason for outcome in outcomes if not outcome.ok)]
        for offset, (step, why) in enumerate(zip(batch, results, strict=True)):
            await self._progress(index + offset + 1, step, why)
        failures = [why for why in results if why]
        if failures:
            raise StepFailed("; ".join(failures))

    async def _add(self, step: AddStep) -> str:
        extra = (*self._command.worker_args, *self._role_args.get(step.role, ()),
                 "--model-version", self._plan.version)
        outcome = await self._control.add(AddWorker(role=step.role, worker_id=step.worker_id), extra)
        if outcome.ok:
            self._unpaired.append(step.worker_id)
            return ""
        return outcome.reason

    def _check_active(self, step: WaitActiveStep) -> str:
        for worker_id in step.worker_ids:
            registration = self._control.members().get(worker_id)
            if registration is None or registration.status is not WorkerStatus.ACTIVE:
                return f"{worker_id} is not active"
            if registration.model_version != self._plan.version or registration.model != self._plan.model:
                return (f"{worker_id} registered {registration.model} version {registration.model_version!r}, "
                        f"not {self._plan.model} {self._plan.version!r}")
        return ""

    async def _progress(self, index: int, step: UpgradeStep, why: str) -> None:
        description = step.describe()
        outcome = "failed" if why else "ok"
        if not why:
            self._done.append(description)
        log.info("upgrade step %d/%d %s: %s", index, len(self._plan.steps), description, outcome)
        await self._control.publish(self._progress_subject, CommandProgress(
            command="upgrade_workers", index=index, total=len(self._plan.steps), step=description, outcome=outcome,
            detail=why))

    async def _undo_round(self) -> None:
        """Uncordon the old workers and remove the new ones of the failed round, if it had
        drained none yet (the old pair serves on)."""
        for worker_id in self._cordoned:
            outcome = await self._control.execute(UncordonWorker(worker_id=worker_id))
            log.info("upgrade: uncordoned %s again: %s %s", worker_id, outcome.outcome, outcome.reason)
        self._cordoned.clear()
        for worker_id in self._unpaired:
            outcome = await self._control.remove(worker_id, self._command.deadline_s)
            log.info("upgrade: removed %s again: %s %s", worker_id, outcome.outcome, outcome.reason)
        self._unpaired.clear()
