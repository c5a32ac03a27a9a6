"""Orchestrator commands (anyone -> `orchestrator.commands`, request/reply), answered with a
`CommandOutcome`.

Each command names what it wants done to the cluster; the orchestrator checks it against
the cluster it sees (e.g. never remove the last decode worker), carries it out by talking
to the worker on its control subject (or through its launcher), waits a bounded time for
the result to show in the members bucket, and answers `ok`, `refused` (nothing was done,
`reason` says why) or `failed` (it was tried and did not finish in time, or errored).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from shared.schemas.common import Message
from shared.schemas.membership import WorkerRegistration, WorkerRole


class CordonWorker(Message, tag="cordon_worker", kw_only=True):
    """Routers send the worker no new work; it keeps what it has and stays registered."""

    worker_id: str


class UncordonWorker(Message, tag="uncordon_worker", kw_only=True):
    worker_id: str


class DrainWorker(Message, tag="drain_worker", kw_only=True):
    """The worker takes no new work, finishes its requests and held KV leases, then leaves
    (`ok` once its registration is gone). `deadline_s` bounds the worker's wait."""

    worker_id: str
    deadline_s: float = 30.0
    force: bool = False  # even if it is the last worker of its kind


class SetWorkerRole(Message, tag="set_worker_role", kw_only=True):
    """Switch a running worker's role without restarting its engine (`ok` once the members
    bucket shows it in the new role)."""

    worker_id: str
    role: WorkerRole
    force: bool = False  # even if it leaves no worker able to decode


class AddWorker(Message, tag="add_worker", kw_only=True):
    """Start a worker through the orchestrator's launcher (`ok` once it registered)."""

    role: WorkerRole
    worker_id: str = ""  # empty: the orchestrator names it


class RemoveWorker(Message, tag="remove_worker", kw_only=True):
    """Drain a worker and, if the orchestrator's launcher started it, stop its process."""

    worker_id: str
    deadline_s: float = 30.0
    force: bool = False


class UpgradeWorkers(Message, tag="upgrade_workers", kw_only=True):
    """Rolling upgrade: replace every worker of `model` not at `model_version` by one of the
    same role started with the new settings, a prefill and a decode worker at a time (add
    the new ones, wait until they are active, drain the old ones), so each version keeps
    both roles while it serves. `ok` once no old worker is left; the outcome's `steps` say
    what was done."""

    model_version: str  # the new version label (part of the compatibility hash)
    worker_args: list[str] = []  # further `tandem worker` flags for the new workers (e.g. another model directory)
    role_args: dict[str, list[str]] = {}  # role name -> further flags for new workers of that role only
    model: str = ""  # empty: the one model the old workers serve
    deadline_s: float = 30.0  # each old worker's drain deadline


class WakeModel(Message, tag="wake_model", kw_only=True):
    """A router holds requests for `model`, which has no worker that can serve them: start one
    through the launcher if the model is one the orchestrator can start (its scale-to-zero
    models) and none is active or starting (`ok` once one is registered; concurrent wakes of a
    model share one start). Sent on `orchestrator.wake`, not the command subject."""

    model: str


class LoadWorkerAdapter(Message, tag="load_worker_adapter", kw_only=True):
    """The worker holds the LoRA adapter `adapter` of its model (`ok` once its registration
    lists it); routers send that adapter's requests to the workers holding it."""

    worker_id: str
    adapter: str


class UnloadWorkerAdapter(Message, tag="unload_worker_adapter", kw_only=True):
    """The worker stops holding `adapter` (`ok` once its registration no longer lists it)."""

    worker_id: str
    adapter: str


class ListWorkers(Message, tag="list_workers", kw_only=True):
    """Every registered worker, and which ones the orchestrator's launcher started."""


OrchestratorCommand = (CordonWorker | UncordonWorker | DrainWorker | SetWorkerRole | AddWorker | RemoveWorker
                       | ListWorkers | UpgradeWorkers | WakeModel | LoadWorkerAdapter | UnloadWorkerAdapter)


class WorkerSummary(msgspec.Struct, kw_only=True, frozen=True):
    registration: WorkerRegistration
    launched: bool = False  # started by the orchestrator's launcher


class CommandOutcome(Message, tag="command_outcome", kw_only=True):
    outcome: Literal["ok", "refused", "failed"]
    reason: str = ""
    worker_id: str = ""
    workers: list[WorkerSummary] = []  # ListWorkers; others: the target's registration after the command
    steps: list[str] = []  # UpgradeWorkers: the steps carried out, in order

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


class CommandProgress(Message, tag="command_progress", kw_only=True):
    """One step of a long command (UpgradeWorkers) as it ends, on `orchestrator.progress`."""

    command: str  # the command's kind, e.g. "upgrade_workers"
    index: int  # 1-based
    total: int
    step: str
    outcome: Literal["ok", "failed"]
    detail: str = ""
