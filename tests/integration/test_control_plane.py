"""The orchestrator's control plane against a real nats-server, with the orchestrator and
two sim workers (a prefill and a decode one) in this process: role switch and cordon with
a request in flight, drain, and the failure outcomes (a worker that does not answer, a
malformed command)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from nats.errors import NoRespondersError

from services.orchestrator.config import OrchestratorConfig, WorkerLauncherConfig
from services.orchestrator.service import OrchestratorService
from services.worker.service import WorkerService
from services.worker.sim.config import SimEngineConfig
from shared.bus import Bus, connect
from shared.codec import Codec, encode
from shared.config import BusConfig, MembershipConfig, WorkerConfig
from shared.request_plane import open_stream
from shared.schemas import (
    GenerateRequest,
    SamplingParams,
    WorkerCapacity,
    WorkerRegistration,
    WorkerRole,
    WorkerStatus,
)
from shared.schemas import orchestrator as commands
from tests.integration.sim_workers import start_sim_worker
from tests.waiting import wait_for

MEMBERSHIP = MembershipConfig(heartbeat_interval_s=0.1, ttl_s=1.0)
outcomes: Codec[commands.CommandOutcome] = Codec(commands.CommandOutcome)


async def start_worker(bus_config: BusConfig, worker_id: str, role: WorkerRole) -> WorkerService:
    config = WorkerConfig(worker_id=worker_id, role=role, bus=bus_config, kv_blocks=64, block_size=16,
                          membership=MEMBERSHIP, load_interval_s=0.05, kv_event_interval_s=0.01,
                          drain_timeout_s=5.0)
    return await start_sim_worker(config, await connect(bus_config.nats_url, f"worker-{worker_id}"),
                                  SimEngineConfig(speedup=20))


@pytest.fixture
async def cluster(bus_config: BusConfig) -> AsyncIterator[tuple[OrchestratorService, dict[str, WorkerService]]]:
    orchestrator_bus = await connect(bus_config.nats_url, "orchestrator")
    orchestrator = OrchestratorService(OrchestratorConfig(bus=bus_config, membership=MEMBERSHIP, command_timeout_s=1.0),
                                       orchestrator_bus)
    await orchestrator.start()
    workers = {"p1": await start_worker(bus_config, "p1", WorkerRole.PREFILL),
               "d1": await start_worker(bus_config, "d1", WorkerRole.DECODE)}
    await wait_for(lambda: set(orchestrator.control.worker_ids()) >= set(workers), 5, "both workers registered")
    yield orchestrator, workers
    for worker in workers.values():
        if not worker.stopped.is_set():
            await worker.stop()
        await worker.bus.close()
        assert worker.engine.load().kv_used_blocks == 0, "blocks leaked"
    await orchestrator.stop()
    await orchestrator_bus.close()


async def ask(bus: Bus, bus_config: BusConfig, command: commands.OrchestratorCommand,
              timeout_s: float = 10.0) -> commands.CommandOutcome:
    deadline = time.monotonic() + 2.0
    while True:
        try:
            reply = await bus.client.request(bus_config.subjects.orchestrator_commands, encode(command),
                                             timeout=timeout_s)
            return outcomes.decode(reply.data)
        except NoRespondersError:
            # Seen once on a loaded CI host right after the orchestrator started (its command
            # subscription flushed): asked again for up to 2 s; an orchestrator that never
            # listens still fails the test.
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


def long_request(request_id: str) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, model="tiny", token_ids=list(range(3, 40)),
                           sampling=SamplingParams(max_tokens=200))


async def test_role_switch_keeps_the_request_in_flight(cluster, bus: Bus, bus_config: BusConfig) -> None:
    orchestrator, workers = cluster
    stream = await open_stream(bus, bus_config.subjects.generate("p1"), long_request("r-old-role"))
    frames = stream.frames()
    await frames.__anext__()  # running on p1, in its old role
    outcome = await ask(bus, bus_config, commands.SetWorkerRole(worker_id="p1", role=WorkerRole.BOTH))
    assert outcome.ok, outcome
    assert workers["p1"].role is WorkerRole.BOTH and workers["p1"].inflight == 1
    assert outcome.workers[0].registration.role is WorkerRole.BOTH
    assert outcome.workers[0].registration.generation == 1
    assert "1 request(s) in flight" in outcome.reason, outcome
    tokens = [t async for frame in frames for t in frame.token_ids]
    await stream.close()
    assert stream.finished is not None and stream.finished.finish_reason == "length" and len(tokens) >= 190
    # The registration the orchestrator mirrors says the same, through later heartbeats too.
    registration = orchestrator.control.registration("p1")
    assert registration.role is WorkerRole.BOTH and registration.generation == 1


async def test_cordon_then_uncordon(cluster, bus: Bus, bus_config: BusConfig) -> None:
    orchestrator, workers = cluster
    refused = await ask(bus, bus_config, commands.CordonWorker(worker_id="d1"))  # the only decode worker
    assert refused.outcome == "refused" and "minimum is 1" in refused.reason
    assert (await ask(bus, bus_config, commands.SetWorkerRole(worker_id="p1", role=WorkerRole.DECODE))).ok
    cordoned = await ask(bus, bus_config, commands.CordonWorker(worker_id="d1"))
    assert cordoned.ok and cordoned.workers[0].registration.status is WorkerStatus.CORDONED
    again = await ask(bus, bus_config, commands.CordonWorker(worker_id="d1"))
    assert again.ok and "already cordoned" in again.reason
    uncordoned = await ask(bus, bus_config, commands.UncordonWorker(worker_id="d1"))
    assert uncordoned.ok and uncordoned.workers[0].registration.status is WorkerStatus.ACTIVE
    assert uncordoned.workers[0].registration.generation == 2


async def test_drain_waits_for_the_request_then_the_worker_leaves(cluster, bus: Bus, bus_config: BusConfig) -> None:
    orchestrator, workers = cluster
    stream = await open_stream(bus, bus_config.subjects.generate("p1"), long_request("r-drained"))
    frames = stream.frames()
    await frames.__anext__()
    drain = asyncio.create_task(ask(bus, bus_config, commands.DrainWorker(worker_id="p1", deadline_s=5.0)))
    tokens = [t async for frame in frames for t in frame.token_ids]
    await stream.close()
    assert stream.finished is not None and len(tokens) >= 190  # finished, not cut off
    outcome = await drain
    assert outcome.ok and outcome.reason == "drained and left", outcome
    assert workers["p1"].stopped.is_set() and orchestrator.control.registration("p1") is None


async def test_a_worker_that_does_not_answer_is_a_failed_outcome(cluster, bus: Bus, bus_config: BusConfig) -> None:
    members = await bus.key_value(bus_config.subjects.members_bucket)
    now = time.time()
    ghost = WorkerRegistration(worker_id="ghost", role=WorkerRole.PREFILL, model="tiny", engine="sim", block_size=16,
                               compat_hash="abc", capacity=WorkerCapacity(kv_blocks=8, max_num_seqs=2,
                                                                          max_model_len=64),
                               started_at=now, heartbeat_at=now)
    await members.put("ghost", encode(ghost))
    orchestrator, _ = cluster
    await wait_for(lambda: orchestrator.control.registration("ghost") is not None, 5, "the ghost registered")
    outcome = await ask(bus, bus_config, commands.SetWorkerRole(worker_id="ghost", role=WorkerRole.DECODE))
    assert outcome.outcome == "failed" and "did not answer" in outcome.reason, outcome
    await members.delete("ghost")


async def test_malformed_command_is_refused(cluster, bus: Bus, bus_config: BusConfig) -> None:
    reply = await bus.client.request(bus_config.subjects.orchestrator_commands, b"\x93nonsense", timeout=5)
    outcome = outcomes.decode(reply.data)
    assert outcome.outcome == "refused" and outcome.reason == "malformed command"


async def test_a_worker_that_cannot_start_is_a_failed_add_with_its_log(bus: Bus, bus_config: BusConfig,
                                                                         tmp_path) -> None:
    config = OrchestratorConfig(bus=bus_config, membership=MEMBERSHIP, command_timeout_s=2.0,
                                launcher=WorkerLauncherConfig(kind="local", model_dir=str(tmp_path / "no-model"),
                                                              log_dir=str(tmp_path / "logs"), start_timeout_s=30))
    orchestrator_bus = await connect(bus_config.nats_url, "orchestrator")
    orchestrator = OrchestratorService(config, orchestrator_bus)
    await orchestrator.start()
    try:
        outcome = await ask(bus, bus_config, commands.AddWorker(role=WorkerRole.DECODE, worker_id="broken"),
                            timeout_s=40)
        assert outcome.outcome == "failed" and "worker broken exited" in outcome.reason, outcome
        assert "no-model" in outcome.reason  # the tail of its log says why
        assert orchestrator.control.launcher.list() == []
    finally:
        await orchestrator.stop()
        await orchestrator_bus.close()
