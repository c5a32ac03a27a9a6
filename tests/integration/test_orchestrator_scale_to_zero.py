"""The orchestrator's half of scale to zero against a real nats-server, with sim workers in
this process started by a stand-in launcher: a `WakeModel` on `orchestrator.wake` starts one
worker of a scalable model (concurrent wakes share it; a model with an active worker starts
none; a model it does not list, or a command other than a wake on that subject, is refused);
an idle model's launched workers are drained and stopped, a worker it did not launch stays;
an operator wakes a model with `tandem ctl wake`."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator

import pytest

from services.orchestrator.config import OrchestratorConfig, ScaleToZeroConfig, WorkerLauncherConfig
from services.orchestrator.launchers import LaunchedWorker, WorkerLaunch
from services.orchestrator.service import OrchestratorService
from services.worker.service import WorkerService
from services.worker.sim.config import SimEngineConfig
from services.worker.sim.engine import SimEngine
from shared.bus import Bus, connect
from shared.codec import Codec, encode
from shared.config import BusConfig, MembershipConfig, WorkerConfig
from shared.schemas import WorkerRole
from shared.schemas.orchestrator import CommandOutcome, ListWorkers, OrchestratorCommand, WakeModel
from tests.waiting import wait_for

MEMBERSHIP = MembershipConfig(heartbeat_interval_s=0.1, ttl_s=1.0)
IDLE_S = 1.0
outcomes: Codec[CommandOutcome] = Codec(CommandOutcome)


async def start_worker(bus_config: BusConfig, worker_id: str, model: str) -> WorkerService:
    config = WorkerConfig(worker_id=worker_id, role=WorkerRole.BOTH, bus=bus_config, kv_blocks=64, block_size=16,
                          membership=MEMBERSHIP, load_interval_s=0.05, kv_event_interval_s=0.01,
                          drain_timeout_s=2.0, served_model_name=model)
    engine = SimEngine(config, SimEngineConfig(speedup=20), model_name=model, vocab_size=512)
    await engine.start()
    service = WorkerService(config, engine, await connect(bus_config.nats_url, f"worker-{worker_id}"))
    await service.start()
    return service


class InProcessLauncher:
    """Starts sim workers in this process, serving the model its `--served-model-name` names."""

    def __init__(self, bus_config: BusConfig) -> None:
        self._bus_config = bus_config
        self.workers: dict[str, WorkerService] = {}
        self.started: list[WorkerLaunch] = []

    async def start_worker(self, spec: WorkerLaunch) -> LaunchedWorker:
        self.started.append(spec)
        model = spec.extra_args[spec.extra_args.index("--served-model-name") + 1]
        self.workers[spec.worker_id] = await start_worker(self._bus_config, spec.worker_id, model)
        return LaunchedWorker(worker_id=spec.worker_id, role=spec.role, pid=os.getpid())

    async def stop_worker(self, handle: LaunchedWorker, timeout_s: float) -> int | None:
        worker = self.workers.pop(handle.worker_id, None)
        if worker is None:
            return None
        if not worker.stopped.is_set():
            await worker.stop()
        await worker.bus.close()
        return 0

    def alive(self, handle: LaunchedWorker) -> bool:
        return handle.worker_id in self.workers

    async def log_tail(self, handle: LaunchedWorker, lines: int = 20) -> str:
        return ""

    def list(self) -> list[LaunchedWorker]:
        return [LaunchedWorker(worker_id=worker_id, role=WorkerRole.BOTH, pid=os.getpid()) for worker_id in self.workers]

    async def recover(self) -> list[LaunchedWorker]:
        return []

    async def stop_all(self, timeout_s: float) -> None:
        for handle in self.list():
            await self.stop_worker(handle, timeout_s)


@pytest.fixture
async def orchestrator(bus_config: BusConfig) -> AsyncIterator[tuple[OrchestratorService, InProcessLauncher]]:
    config = OrchestratorConfig(
        bus=bus_config, membership=MEMBERSHIP, command_timeout_s=2.0,
        launcher=WorkerLauncherConfig(kind="local", model_dir="/unused", start_timeout_s=10),
        scale_to_zero=ScaleToZeroConfig(models=("cold=/models/cold", "warm=/models/warm"), idle_s=IDLE_S, interval_s=0.1,
                                        drain_deadline_s=2.0))
    config.validate()
    launcher = InProcessLauncher(bus_config)
    orchestrator_bus = await connect(bus_config.nats_url, "orchestrator")
    service = OrchestratorService(config, orchestrator_bus, launcher=launcher)
    await service.start()
    yield service, launcher
    await service.stop()
    await orchestrator_bus.close()


async def wake(bus: Bus, bus_config: BusConfig, command: OrchestratorCommand) -> CommandOutcome:
    reply = await bus.client.request(bus_config.subjects.orchestrator_wake, encode(command), timeout=15)
    return outcomes.decode(reply.data)


async def test_concurrent_wakes_start_one_worker_which_idles_back_to_zero(orchestrator, bus: Bus,
                                                                          bus_config: BusConfig) -> None:
    service, launcher = orchestrator
    # a worker of another scalable model that the orchestrator did not launch: never stopped
    own = await start_worker(bus_config, "warm-own", "warm")
    try:
        await wait_for(lambda: "warm-own" in service.control.worker_ids(), 5, "the worker registered")
        first, second = await asyncio.gather(wake(bus, bus_config, WakeModel(model="cold")),
                                             wake(bus, bus_config, WakeModel(model="cold")))
        assert first.ok and second.ok, (first, second)
        [started] = launcher.started
        assert first.worker_id == second.worker_id == started.worker_id
        assert started.extra_args == ("--model-dir", "/models/cold", "--served-model-name", "cold")
        again = await wake(bus, bus_config, WakeModel(model="cold"))
        assert again.ok and "has an active worker" in again.reason and len(launcher.started) == 1

        await wait_for(lambda: not launcher.workers, IDLE_S + 5, "the idle model's worker stopped")
        await wait_for(lambda: started.worker_id not in service.control.worker_ids(), 5, "its registration gone")
        assert service.model_scaler is not None
        assert [idle.model for idle in service.model_scaler.scaled_down] == ["cold"]
        assert "warm-own" in service.control.worker_ids()  # idle as long, but not the orchestrator's to stop
    finally:
        await own.stop()
        await own.bus.close()


async def test_an_unlisted_model_or_another_command_on_the_wake_subject_is_refused(orchestrator, bus: Bus,
                                                                                 bus_config: BusConfig) -> None:
    _, launcher = orchestrator
    unknown = await wake(bus, bus_config, WakeModel(model="ghost"))
    assert unknown.outcome == "refused" and "not one this orchestrator starts" in unknown.reason
    other = await wake(bus, bus_config, ListWorkers())
    assert other.outcome == "refused" and "not a wake_model command" in other.reason
    assert not launcher.started


async def test_an_operator_wakes_a_model_with_tandem_ctl_wake(orchestrator, bus_config: BusConfig) -> None:
    _, launcher = orchestrator
    woken = await asyncio.to_thread(subprocess.run, [
        sys.executable, "-m", "cli.main", "ctl", "wake", "cold", "--nats-url", bus_config.nats_url,
        "--namespace", bus_config.namespace], capture_output=True, text=True, timeout=60)
    assert woken.returncode == 0, woken
    [started] = launcher.started
    assert started.worker_id in woken.stdout and "ok" in woken.stdout
    refused = await asyncio.to_thread(subprocess.run, [
        sys.executable, "-m", "cli.main", "ctl", "wake", "ghost", "--nats-url", bus_config.nats_url,
        "--namespace", bus_config.namespace], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "not one this orchestrator starts" in refused.stdout, refused
