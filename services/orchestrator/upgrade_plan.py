"""The rolling upgrade's plan (pure): the workers as the orchestrator sees them and the
target version in, the ordered steps (or why there can be none) out.

Every worker of the model not at the target version is replaced by one of the same role.
Prefill and decode workers go together, a prefill and a decode one per round:

    add new prefill, add new decode -> wait until both are active
    -> cordon both old ones -> drain the old prefill worker -> drain the old decode worker

so neither version is ever left with prefill workers but no decode worker (or the
reverse) while it serves: the new version gets one of each in the first round before
anything is drained, and the old version loses its last prefill and its last decode
worker in the same (last) round, cordoned together (routers stop sending it work at
once); the prefill worker drains first, so the decode worker still takes the hand-offs of
requests in flight. When one role has more old workers
than the other, its extra ones are replaced in the first rounds (the other role's new
worker, added in the first round, waits for its old one's turn in the last). Workers that serve whole requests
(role both) are replaced one per round after the pairs.

At any point at most one worker of each role is above the starting count, so the plan needs
room in the budget (`WorkerLimits.max_workers`, and the per-role maxima) for that many
workers above the current count; it is refused, with the reason, when there is not.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from services.orchestrator.config import WorkerLimits
from shared.schemas import WorkerRole, WorkerStatus

PAIRED_ROLES = (WorkerRole.PREFILL, WorkerRole.DECODE)


@dataclass(frozen=True, slots=True)
class CurrentWorker:
    worker_id: str
    role: WorkerRole
    model: str
    version: str  # the model version label of its compat hash
    compat_hash: str = ""
    status: WorkerStatus = WorkerStatus.ACTIVE


@dataclass(frozen=True, slots=True)
class AddStep:
    """Start a new-version worker of `role` named `worker_id`."""

    worker_id: str
    role: WorkerRole

    def describe(self) -> str:
        return f"add {self.role.value} {self.worker_id}"


@dataclass(frozen=True, slots=True)
class _WorkersStep:
    """A step taken on `worker_ids` together; `action` says what, with `{}` for the workers."""

    action: ClassVar[str]
    worker_ids: tuple[str, ...]

    def describe(self) -> str:
        return self.action.format(", ".join(self.worker_ids))


@dataclass(frozen=True, slots=True)
class WaitActiveStep(_WorkersStep):
    """Wait until every one of `worker_ids` is registered and ACTIVE."""

    action = "wait until {} active"


@dataclass(frozen=True, slots=True)
class CordonStep(_WorkersStep):
    """Cordon `worker_ids` together: routers send them no new request; hand-offs of requests
    already routed to them are still taken."""

    action = "cordon {}"


@dataclass(frozen=True, slots=True)
class DrainStep(_WorkersStep):
    """Drain `worker_ids` together (and stop their processes if the orchestrator started them)."""

    action = "drain {}"


UpgradeStep = AddStep | WaitActiveStep | CordonStep | DrainStep


@dataclass(frozen=True, slots=True)
class UpgradePlan:
    model: str
    version: str
    steps: tuple[UpgradeStep, ...]
    extra_workers: int  # the most workers above the current count at any point

    def describe(self) -> list[str]:
        return [step.describe() for step in self.steps]


def plan_upgrade(workers: Sequence[CurrentWorker], version: str, limits: WorkerLimits, *, model: str = "",
                 name_prefix: str = "") -> UpgradePlan | str:
    """The steps that take `model`'s workers to `version` (none when they are all there),
    or why the upgrade must not run.

    Draining workers are left alone (they are already leaving). New workers are named
    `<prefix><role>-<version>-<n>` (the version's other characters as '_') with names no current worker has.
    """
    if not version:
        return "name the version to upgrade to"
    models = sorted({w.model for w in workers if w.version != version and w.status is not WorkerStatus.DRAINING})
    if model:
        models = [m for m in models if m == model]
    elif len(models) > 1:
        return f"the workers serve several models ({', '.join(models)}): name the one to upgrade"
    if not models:
        return UpgradePlan(model=model, version=version, steps=(), extra_workers=0)
    model = models[0]
    old = [w for w in workers if w.model == model and w.version != version and w.status is not WorkerStatus.DRAINING]
    by_role = {role: sorted(w.worker_id for w in old if w.role is role) for role in WorkerRole}
    roles = {w.worker_id: w.role for w in old}
    rounds = _rounds(by_role)
    extra = _peak_extra(rounds)
    why = _no_room(workers, rounds, extra, limits)
    if why:
        return why
    taken = {w.worker_id for w in workers}
    steps: list[UpgradeStep] = []
    for adds, drains in rounds:
        added = []
        for role in adds:
            worker_id = _fresh_name(f"{name_prefix}{role.value}-{_token(version)}", taken)
            taken.add(worker_id)
            added.append(worker_id)
            steps.append(AddStep(worker_id=worker_id, role=role))
        if added:
            steps.append(WaitActiveStep(worker_ids=tuple(added)))
        steps += _retire(drains, roles)
    return UpgradePlan(model=model, version=version, steps=tuple(steps), extra_workers=extra)


def _retire(worker_ids: list[str], roles: dict[str, WorkerRole]) -> list[UpgradeStep]:
    """The steps that take a round's old workers out. A prefill and a decode worker are
    cordoned together (no new request reaches either), then the prefill worker drains (it
    leaves once its decode workers have pulled its KV), then the decode one: a decode
    worker never refuses the hand-off of a request its prefill partner is still working on."""
    prefills = tuple(w for w in worker_ids if roles[w] is WorkerRole.PREFILL)
    others = tuple(w for w in worker_ids if roles[w] is not WorkerRole.PREFILL)
    if not prefills or not others:
        return [DrainStep(worker_ids=tuple(worker_ids))] if worker_ids else []
    return [CordonStep(worker_ids=tuple(worker_ids)), DrainStep(worker_ids=prefills), DrainStep(worker_ids=others)]


Round = tuple[list[WorkerRole], list[str]]  # the roles of the workers added, then the old workers drained


def _rounds(by_role: dict[WorkerRole, list[str]]) -> list[Round]:
    """The paired roles over as many rounds as the larger of them has old workers: each
    role adds a new worker in the first round (the new version gets every role at once)
    and drains its old ones in the last rounds (the last of each role in the last round),
    adding one more before each drain but its last. Then the `both` workers, one a round."""
    paired = {role: by_role[role] for role in PAIRED_ROLES if by_role[role]}
    count = max((len(ids) for ids in paired.values()), default=0)
    rounds: list[Round] = [([], []) for _ in range(count)]
    for role, ids in paired.items():
        first_drain = count - len(ids)
        for index in [0, *range(first_drain + 1, count)]:
            rounds[index][0].append(role)
        for index, worker_id in zip(range(first_drain, count), ids, strict=True):
            rounds[index][1].append(worker_id)
    rounds += [([WorkerRole.BOTH], [worker_id]) for worker_id in by_role[WorkerRole.BOTH]]
    return rounds


def _peak_extra(rounds: list[Round]) -> int:
    """The most workers above the starting count at any point (after a round's adds)."""
    extra = peak = 0
    for adds, drains in rounds:
        extra += len(adds)
        peak = max(peak, extra)
        extra -= len(drains)
    return peak


def _no_room(workers: Sequence[CurrentWorker], rounds: list[Round], extra: int, limits: WorkerLimits) -> str:
    total = len(workers)
    if limits.max_workers:
        headroom = limits.max_workers - total
        if headroom <= 0:
            return (f"the cluster is at its budget of {limits.max_workers} workers: a rolling upgrade needs room "
                    f"for at least one extra worker")
        if headroom < extra:
            return (f"a rolling upgrade adds a new prefill and a new decode worker before it drains an old pair, "
                    f"so it needs room for {extra} extra workers; the budget of {limits.max_workers} leaves "
                    f"{headroom} above the current {total}")
    roles_added = {role for adds, _ in rounds for role in adds}
    prefills = sum(w.role is WorkerRole.PREFILL for w in workers)
    serving = sum(w.role is not WorkerRole.PREFILL for w in workers)
    if WorkerRole.PREFILL in roles_added and limits.max_prefill_workers and prefills >= limits.max_prefill_workers:
        return (f"already {prefills} prefill worker(s), the maximum is {limits.max_prefill_workers}: no room for "
                f"a new one beside an old one")
    serving_added = roles_added - {WorkerRole.PREFILL}
    if serving_added and limits.max_serving_workers and serving >= limits.max_serving_workers:
        return (f"already {serving} decode worker(s), the maximum is {limits.max_serving_workers}: no room for "
                f"a new one beside an old one")
    return ""


def _token(text: str) -> str:
    """`text` as a piece of a worker id (letters, digits, '-' and '_')."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", text)


def _fresh_name(stem: str, taken: set[str]) -> str:
    number = 1
    while f"{stem}-{number}" in taken:
        number += 1
    return f"{stem}-{number}"
