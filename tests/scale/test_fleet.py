"""A small fleet in this process against a real nats-server: each worker registers and
serves under its own id, heartbeats and load snapshots come from the shared ticker, KV
events from a worker that ran a request arrive numbered from 1, a drained worker leaves
alone, and stopping the fleet deregisters the rest. Plus the ticker's slicing (pure)."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator

import msgspec
import pytest
from nats.js.errors import KeyNotFoundError

from services.worker.config import FleetConfig
from services.worker.fleet import WorkerFleet
from services.worker.fleet_ticker import slice_groups
from services.worker.sim.config import SimEngineConfig
from shared.bus import Bus
from shared.codec import Codec, encode
from shared.config import BusConfig, ConfigError, MembershipConfig, WorkerConfig
from shared.request_plane import open_stream
from shared.schemas import Drain, GenerateRequest, KvEventBatch, LoadSnapshot, SamplingParams, WorkerRegistration
from tests.waiting import wait_for

COUNT = 6


def fleet_config(bus_config: BusConfig, model_dir: str, **overrides) -> FleetConfig:
    worker = WorkerConfig(worker_id="template", model_dir=model_dir, kv_blocks=64,
                          load_interval_s=0.1, kv_event_interval_s=0.01, bus=bus_config,
                          membership=MembershipConfig(heartbeat_interval_s=0.1, ttl_s=1.0))
    return FleetConfig(worker=worker, sim=SimEngineConfig(kv_dim=8, speedup=50), count=COUNT, id_prefix="f-", first_index=10, connections=2,
                       start_concurrency=4, **overrides)


@pytest.fixture
async def fleet(bus_config: BusConfig, tiny_model_dir: str) -> AsyncIterator[WorkerFleet]:
    running = WorkerFleet(fleet_config(bus_config, tiny_model_dir))
    await running.start()
    yield running
    await running.stop()


def test_slices_spread_workers_evenly_over_the_interval() -> None:
    groups = slice_groups(1024, 1.0, 0.01)
    assert len(groups) == 100 and sorted(i for group in groups for i in group) == list(range(1024))
    assert {len(group) for group in groups} == {10, 11}
    assert slice_groups(3, 1.0, 0.01) == [[0], [1], [2]]  # never more slices than workers
    assert slice_groups(1024, 0.02, 0.01) == [list(range(0, 1024, 2)), list(range(1, 1024, 2))]
    assert slice_groups(5, 0.001, 0.01) == [[0, 1, 2, 3, 4]]
    assert slice_groups(0, 1.0) == []


def test_config_names_workers_and_refuses_other_engines(bus_config: BusConfig) -> None:
    config = fleet_config(bus_config, "/models/tiny")
    assert [config.worker_config(i).worker_id for i in (10, 15)] == ["f-0010", "f-0015"]
    with pytest.raises(ConfigError, match="sim"):
        msgspec.structs.replace(config, worker=msgspec.structs.replace(config.worker, engine="vllm")).validate()
    with pytest.raises(ConfigError):
        msgspec.structs.replace(config, count=0).validate()


async def test_workers_register_serve_and_leave_one_by_one(fleet: WorkerFleet, bus: Bus,
                                                            bus_config: BusConfig) -> None:
    subjects = bus_config.subjects
    ids = [f"f-{index:04d}" for index in range(10, 10 + COUNT)]
    assert fleet.worker_ids == ids
    members = await bus.key_value(subjects.members_bucket)
    registrations = Codec(WorkerRegistration)

    heartbeats: Counter[str] = Counter()
    loads: Counter[str] = Counter()
    batches: list[KvEventBatch] = []

    async def on_heartbeat(msg) -> None:
        heartbeats[msg.subject.rsplit(".", 1)[1]] += 1

    async def on_load(msg) -> None:
        loads[Codec(LoadSnapshot).decode(msg.data).worker_id] += 1

    async def on_batch(msg) -> None:
        batches.append(Codec(KvEventBatch).decode(msg.data))

    await bus.client.subscribe(f"$KV.{subjects.members_bucket}.>", cb=on_heartbeat)
    await bus.client.subscribe(subjects.load_all, cb=on_load)
    await bus.client.subscribe(subjects.kv_events_all, cb=on_batch)
    await wait_for(lambda: all(heartbeats[w] >= 2 and loads[w] >= 2 for w in ids), 5,
                   lambda: f"heartbeats {heartbeats} and load snapshots {loads} from every worker")
    for worker_id in ids:
        assert registrations.decode((await members.get(worker_id)).value).worker_id == worker_id

    prompt = list(range(3, 3 + 40))
    request = GenerateRequest(request_id="r1", model=fleet.services[2].engine.info.model, token_ids=prompt,
                              sampling=SamplingParams(max_tokens=5))
    stream = await open_stream(bus, subjects.generate(ids[2]), request)
    tokens = [t async for frame in stream.frames() for t in frame.token_ids]
    await stream.close()
    assert len(tokens) == 5
    await wait_for(lambda: any(batch.worker_id == ids[2] for batch in batches), 5, "KV events of the worker used")
    assert {batch.worker_id for batch in batches} == {ids[2]}
    assert [batch.seq for batch in batches] == list(range(1, len(batches) + 1))

    reply = await bus.client.request(subjects.control(ids[0], "drain"), encode(Drain(deadline_s=1.0)), timeout=5)
    assert reply.data
    await wait_for(lambda: fleet.services[0].stopped.is_set(), 5, "the drained worker stopped")

    async def gone(worker_id: str) -> bool:
        try:
            await members.get(worker_id)
        except KeyNotFoundError:
            return True
        return False

    await wait_for(lambda: gone(ids[0]), 5, "the drained worker deregistered")
    assert not await gone(ids[1]) and not fleet.stopped.is_set()
    served_before = dict(heartbeats)
    await wait_for(lambda: all(heartbeats[w] > served_before[w] for w in ids[1:]), 5, "the others heartbeat on")

    await fleet.stop()
    for worker_id in ids:
        assert await gone(worker_id), worker_id
