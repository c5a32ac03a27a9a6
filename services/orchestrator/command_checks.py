"""Whether an orchestrator command may run against the cluster as the orchestrator sees it.
Pure: the members bucket's registrations and the configured limits in, a refusal reason
(or None) out. Called by `control_plane.ControlPlane` before it does anything.

The invariants kept: a model keeps `min_serving_workers` ACTIVE workers able to decode
(role decode or both) and `min_prefill_workers` prefill ones, unless the command says
`force`; adding or switching a worker never goes past the per-role maxima or the total
budget; a command names a worker that exists (or, for AddWorker, one that does not).
"""

from __future__ import annotations

from collections.abc import Mapping

from services.orchestrator.config import WorkerLimits
from shared.schemas import WorkerRegistration, WorkerRole, WorkerStatus
from shared.schemas import orchestrator as commands

SERVING_ROLES = frozenset({WorkerRole.DECODE, WorkerRole.BOTH})


def serves(role: WorkerRole) -> bool:
    return role in SERVING_ROLES


def refusal(command: commands.OrchestratorCommand, members: Mapping[str, WorkerRegistration], limits: WorkerLimits, *,
            can_launch: bool) -> str | None:
    """Why `command` must not run now; None when it may."""
    match command:
        case commands.ListWorkers():
            return None
        case commands.UpgradeWorkers():  # the plan (upgrade_plan.py) checks the budget and the roles
            return None if can_launch else "this orchestrator has no worker launcher (start it with --launcher local)"
        case commands.WakeModel():  # a start like AddWorker's, of a worker serving both parts
            return refusal(commands.AddWorker(role=WorkerRole.BOTH), members, limits, can_launch=can_launch)
        case commands.AddWorker(role=role, worker_id=worker_id):
            if not can_launch:
                return "this orchestrator has no worker launcher (start it with --launcher local)"
            if worker_id and worker_id in members:
                return f"a worker named {worker_id} is already registered"
            if limits.max_workers and len(members) >= limits.max_workers:
                return f"the cluster is at its budget of {limits.max_workers} workers"
            return _role_full(role, members, limits)
    target = members.get(command.worker_id)  # every other command names a registered worker
    if target is None:
        return f"no registered worker named {command.worker_id}"
    match command:
        case commands.CordonWorker():
            return _last_serving(target, members, limits, force=False, action="cordon")
        case commands.UncordonWorker() | commands.UnloadWorkerAdapter():
            return None
        case commands.LoadWorkerAdapter(adapter=adapter):
            if not target.adapter_slots:
                return f"{target.worker_id} serves no LoRA adapters (start it with --max-adapters)"
            return None if adapter else "no adapter named"
        case commands.DrainWorker(force=force):
            return _last_serving(target, members, limits, force=force, action="drain")
        case commands.RemoveWorker(force=force):
            return _last_serving(target, members, limits, force=force, action="remove")
        case commands.SetWorkerRole(role=role, force=force):
            if role is target.role:
                return f"{target.worker_id} already serves as {role.value}"
            if target.status is WorkerStatus.DRAINING:
                return f"{target.worker_id} is draining"
            if serves(role) == serves(target.role):  # decode <-> both changes no count
                return None
            return (_last_serving(target, members, limits, force=force, action=f"switch to {role.value}")
                    or _role_full(role, {k: v for k, v in members.items() if k != target.worker_id}, limits))
    raise AssertionError(f"unknown command {command!r}")


def _last_serving(target: WorkerRegistration, members: Mapping[str, WorkerRegistration], limits: WorkerLimits, *,
                  force: bool, action: str) -> str | None:
    """Refuse taking `target` out of its kind of service (decode, or prefill) when fewer
    active workers of that kind than the minimum would remain."""
    if force or target.status is not WorkerStatus.ACTIVE:
        return None
    decodes = serves(target.role)
    minimum = limits.min_serving_workers if decodes else limits.min_prefill_workers
    others = [worker_id for worker_id, registration in members.items()
              if worker_id != target.worker_id and registration.model == target.model
              and serves(registration.role) == decodes and registration.status is WorkerStatus.ACTIVE]
    if len(others) >= minimum:
        return None
    kind = "decode" if decodes else "prefill"
    return (f"refusing to {action} {target.worker_id}: {len(others)} other active {kind} worker(s) of "
            f"{target.model} would remain, the minimum is {minimum} (force overrides)")


def _role_full(role: WorkerRole, members: Mapping[str, WorkerRegistration], limits: WorkerLimits) -> str | None:
    if serves(role):
        count = sum(serves(registration.role) for registration in members.values())
        if limits.max_serving_workers and count >= limits.max_serving_workers:
            return f"already {count} decode worker(s), the maximum is {limits.max_serving_workers}"
        return None
    count = sum(registration.role is WorkerRole.PREFILL for registration in members.values())
    if limits.max_prefill_workers and count >= limits.max_prefill_workers:
        return f"already {count} prefill worker(s), the maximum is {limits.max_prefill_workers}"
    return None
