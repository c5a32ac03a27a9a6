"""The rolling upgrade (`services/orchestrator/rolling_upgrade.py`) carried out against a plain
in-memory `WorkerCommands` (no control plane, no bus, no launcher): the steps in order with
their progress, a round undone when its new workers register the wrong version, and a
second upgrade refused while one runs."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import msgspec

from services.orchestrator.config import OrchestratorConfig
from services.orchestrator.rolling_upgrade import rolling_upgrade, upgrade_running
from shared.schemas import WorkerCapacity, WorkerRegistration, WorkerRole, WorkerStatus
from shared.schemas.orchestrator import (
    AddWorker,
    CommandOutcome,
    CommandProgress,
    CordonWorker,
    OrchestratorCommand,
    UncordonWorker,
    UpgradeWorkers,
    WorkerSummary,
)

PREFILL, DECODE = WorkerRole.PREFILL, WorkerRole.DECODE
CONFIG = OrchestratorConfig()


def registration(worker_id: str, role: WorkerRole, version: str) -> WorkerRegistration:
    return WorkerRegistration(worker_id=worker_id, role=role, model="tiny", engine="sim", block_size=16,
                              compat_hash=f"hash-{version}", model_version=version,
                              capacity=WorkerCapacity(kv_blocks=64, max_num_seqs=8, max_model_len=2048),
                              started_at=1.0, heartbeat_at=1.0)


class Fleet:
    """The members bucket and the control plane's commands as plain data: an added worker
    registers at once with the `--model-version` of its flags (or `registers_version`), a
    removed one leaves, a cordon is a status."""

    def __init__(self, *workers: WorkerRegistration, registers_version: str = "") -> None:
        self.workers = {worker.worker_id: worker for worker in workers}
        self.registers_version = registers_version
        self.calls: list[str] = []
        self.progress: list[CommandProgress] = []
        self.gate: asyncio.Event | None = None  # set: adds wait on it

    def members(self) -> Mapping[str, WorkerRegistration]:
        return self.workers

    def summaries(self) -> list[WorkerSummary]:
        return [WorkerSummary(registration=worker) for _, worker in sorted(self.workers.items())]

    def done(self, worker_id: str, reason: str) -> CommandOutcome:
        return CommandOutcome(outcome="ok", worker_id=worker_id, reason=reason)

    async def execute(self, command: OrchestratorCommand) -> CommandOutcome:
        assert isinstance(command, CordonWorker | UncordonWorker), command
        status = WorkerStatus.CORDONED if isinstance(command, CordonWorker) else WorkerStatus.ACTIVE
        self.calls.append(f"{type(command).__name__} {command.worker_id}")
        self.workers[command.worker_id] = msgspec.structs.replace(self.workers[command.worker_id], status=status)
        return self.done(command.worker_id, "")

    async def add(self, command: AddWorker, extra_args: tuple[str, ...] = ()) -> CommandOutcome:
        if self.gate is not None:
            await self.gate.wait()
        version = self.registers_version or extra_args[extra_args.index("--model-version") + 1]
        self.calls.append(f"add {command.worker_id} {' '.join(extra_args)}")
        self.workers[command.worker_id] = registration(command.worker_id, command.role, version)
        return self.done(command.worker_id, "started")

    async def remove(self, worker_id: str, deadline_s: float) -> CommandOutcome:
        self.calls.append(f"remove {worker_id}")
        del self.workers[worker_id]
        return self.done(worker_id, "drained and left")

    async def publish(self, subject: str, message: msgspec.Struct) -> None:
        assert subject == CONFIG.bus.subjects.orchestrator_progress and isinstance(message, CommandProgress)
        self.progress.append(message)


def old_pair() -> tuple[WorkerRegistration, WorkerRegistration]:
    return registration("p-old", PREFILL, "v1"), registration("d-old", DECODE, "v1")


async def test_a_pair_is_replaced_add_wait_cordon_drain_with_every_step_published() -> None:
    fleet = Fleet(*old_pair())
    command = UpgradeWorkers(model_version="v2", worker_args=["--model-dir", "/m/v2"])
    outcome = await rolling_upgrade(fleet, CONFIG, command)
    assert outcome.ok, outcome.reason
    assert {worker.model_version for worker in fleet.workers.values()} == {"v2"}
    assert sorted(worker.role for worker in fleet.workers.values()) == sorted([PREFILL, DECODE])
    assert [progress.outcome for progress in fleet.progress] == ["ok"] * len(outcome.steps)
    assert [progress.index for progress in fleet.progress] == list(range(1, len(outcome.steps) + 1))
    assert all(call.endswith("--model-dir /m/v2 --model-version v2") for call in fleet.calls if call.startswith("add"))
    assert fleet.calls[2:] == ["CordonWorker p-old", "CordonWorker d-old", "remove p-old", "remove d-old"]
    assert [summary.registration.worker_id for summary in outcome.workers] == sorted(fleet.workers)


async def test_new_workers_of_the_wrong_version_fail_the_round_and_it_is_undone() -> None:
    fleet = Fleet(*old_pair(), registers_version="v1")  # their flags did not change the version
    outcome = await rolling_upgrade(fleet, CONFIG, UpgradeWorkers(model_version="v2"))
    assert outcome.outcome == "failed" and "version 'v1'" in outcome.reason
    assert sorted(fleet.workers) == ["d-old", "p-old"]  # the new pair removed again
    assert all(worker.status is WorkerStatus.ACTIVE for worker in fleet.workers.values())
    assert fleet.progress[-1].outcome == "failed"


async def test_a_second_upgrade_is_refused_while_one_runs() -> None:
    fleet = Fleet(*old_pair())
    fleet.gate = asyncio.Event()
    first = asyncio.create_task(rolling_upgrade(fleet, CONFIG, UpgradeWorkers(model_version="v2")))
    await asyncio.sleep(0)  # the first one starts and waits at its first add
    assert upgrade_running(fleet)
    second = await rolling_upgrade(fleet, CONFIG, UpgradeWorkers(model_version="v3"))
    assert second.outcome == "refused" and "already running" in second.reason
    fleet.gate.set()
    assert (await first).ok
    assert not upgrade_running(fleet)
