"""The worker service with a real sim engine against a real nats-server: request plane,
membership registration, KV and load events, cancel, drain, snapshot, bad messages."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgspec
import pytest
from nats.js.errors import KeyNotFoundError

from services.worker.service import WorkerService
from services.worker.sim.config import SimEngineConfig
from services.worker.sim.engine import SimEngine
from shared.block_hash import block_hash_chain
from shared.bus import Bus, connect
from shared.codec import Codec, encode
from shared.config import BusConfig, MembershipConfig, WorkerConfig
from shared.errors import InvalidArgument, NotFound, Unavailable
from shared.request_plane import ResponseInbox, ResponseStream, open_stream
from shared.schemas import (
    AllBlocksCleared,
    BlockStored,
    Cancel,
    Drain,
    GenerateRequest,
    KvEventBatch,
    KvSnapshotRequest,
    LoadSnapshot,
    SamplingParams,
    WorkerRegistration,
    WorkerStatus,
)
from tests.integration.sim_workers import start_sim_worker
from tests.waiting import wait_for
from tests.worker_answers import whole_answer

FAST = SimEngineConfig(speedup=20)  # the workers' sim

@pytest.fixture
async def worker(bus: Bus, bus_config: BusConfig) -> AsyncIterator[WorkerService]:
    config = WorkerConfig(worker_id="w1", bus=bus_config, kv_blocks=64, block_size=16,
                          membership=MembershipConfig(heartbeat_interval_s=0.1, ttl_s=1.0),
                          load_interval_s=0.05, kv_event_interval_s=0.01)
    service = await start_sim_worker(config, bus, FAST)
    yield service
    if not service.stopped.is_set():
        await service.stop()
    assert service.engine.load().kv_used_blocks == 0, "blocks leaked"


def request(request_id: str, tokens: list[int], max_tokens: int = 8, model: str = "tiny") -> GenerateRequest:
    return GenerateRequest(request_id=request_id, model=model, token_ids=tokens,
                           sampling=SamplingParams(max_tokens=max_tokens))


async def test_generate_registers_and_publishes_events(worker: WorkerService, bus: Bus, bus_config: BusConfig) -> None:
    subjects = bus_config.subjects
    batches: list[KvEventBatch] = []
    loads: list[LoadSnapshot] = []
    kv_codec, load_codec = Codec(KvEventBatch), Codec(LoadSnapshot)
    await bus.client.subscribe(subjects.kv_events("w1"), cb=collector(batches, kv_codec))
    await bus.client.subscribe(subjects.load("w1"), cb=collector(loads, load_codec))

    members = await bus.key_value(subjects.members_bucket)
    registration = Codec(WorkerRegistration).decode((await members.get("w1")).value)
    assert registration.model == "tiny" and registration.block_size == 16 and registration.status is WorkerStatus.ACTIVE
    assert registration.compat_hash == worker.engine.info.compat_hash

    prompt = list(range(3, 3 + 40))
    tokens, finished = await whole_answer(bus, subjects.generate("w1"), request("r1", prompt))
    assert len(tokens) == 8 and finished.finish_reason == "length" and finished.prompt_tokens == 40
    again, finished_again = await whole_answer(bus, subjects.generate("w1"), request("r2", prompt))
    assert again == tokens
    assert finished_again.cached_tokens == 32  # two full blocks of the prompt were cached

    await wait_for(lambda: any(isinstance(e, BlockStored) for b in batches for e in b.events), what="BlockStored")
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    assert stored[0].block_hashes[:2] == block_hash_chain(prompt, 16)[:2]
    assert [b.seq for b in batches] == list(range(1, len(batches) + 1))
    await wait_for(lambda: len(loads) >= 2 and loads[-1].prompt_tokens_total >= 80, what="load snapshots")
    assert loads[-1].cached_tokens_total == 32 and loads[-1].kv_used_blocks == 0


def collector(items: list, codec: Codec):
    async def on_message(msg) -> None:
        items.append(codec.decode(msg.data))

    return on_message


async def test_errors_are_explicit(worker: WorkerService, bus: Bus, bus_config: BusConfig) -> None:
    subject = bus_config.subjects.generate("w1")
    with pytest.raises(NotFound):
        await whole_answer(bus, subject, request("r-model", [5, 6], model="other"))
    with pytest.raises(InvalidArgument):
        await whole_answer(bus, subject, request("r-long", [5] * 4000))
    await bus.client.publish(subject, b"\x00garbage", reply=bus.client.new_inbox())
    await bus.client.publish(bus_config.subjects.control("w1", "cancel"), b"\x93garbage")
    tokens, _ = await whole_answer(bus, subject, request("r-ok", [5, 6, 7]))  # still serving
    assert len(tokens) == 8
    await wait_for(lambda: worker.malformed.total == 2, what="malformed count")


async def test_cancel_frees_blocks(worker: WorkerService, bus: Bus, bus_config: BusConfig) -> None:
    subjects = bus_config.subjects
    stream = await open_stream(bus, subjects.generate("w1"), request("r-cancel", list(range(3, 60)), max_tokens=500))
    frames = stream.frames()
    await frames.__anext__()  # the first tokens arrived: the request is running
    assert worker.engine.load().kv_used_blocks > 0
    await bus.client.publish(subjects.control("w1", "cancel"), encode(Cancel(request_id="r-cancel")))
    with pytest.raises(Exception) as raised:
        async for _ in frames:
            pass
    assert "cancel" in str(raised.value)
    await stream.close()
    await wait_for(lambda: worker.engine.load().kv_used_blocks == 0 and worker.inflight == 0, what="blocks freed")


async def test_snapshot_request_reannounces_blocks(worker: WorkerService, bus: Bus, bus_config: BusConfig) -> None:
    subjects = bus_config.subjects
    await whole_answer(bus, subjects.generate("w1"), request("r1", list(range(3, 3 + 48))))
    batches: list[KvEventBatch] = []
    codec = Codec(KvEventBatch)
    await bus.client.subscribe(subjects.kv_events("w1"), cb=collector(batches, codec))
    await bus.client.publish(subjects.control("w1", "kv_snapshot"), encode(KvSnapshotRequest()))
    await wait_for(lambda: any(isinstance(e, AllBlocksCleared) for b in batches for e in b.events), what="snapshot")
    snapshot = next(b for b in batches if any(isinstance(e, AllBlocksCleared) for e in b.events))
    stored = {h for e in snapshot.events if isinstance(e, BlockStored) for h in e.block_hashes}
    assert set(block_hash_chain(list(range(3, 3 + 48)), 16)) <= stored


async def test_drain_finishes_inflight_then_deregisters(worker: WorkerService, bus: Bus, bus_config: BusConfig) -> None:
    subjects = bus_config.subjects
    running = asyncio.create_task(whole_answer(bus, subjects.generate("w1"), request("r-drain", [4, 5, 6], max_tokens=40)))
    await wait_for(lambda: worker.inflight == 1, what="request in flight")
    await bus.client.publish(subjects.control("w1", "drain"), encode(Drain(deadline_s=10)))
    await wait_for(lambda: worker.registration().status is WorkerStatus.DRAINING, what="draining")
    with pytest.raises(Unavailable):
        await whole_answer(bus, subjects.generate("w1"), request("r-new", [4, 5]))
    tokens, finished = await running
    assert len(tokens) == 40 and finished.finish_reason == "length"  # in-flight work finished
    await asyncio.wait_for(worker.stopped.wait(), 5)
    members = await bus.key_value(subjects.members_bucket)
    with pytest.raises(KeyNotFoundError):
        await members.get("w1")  # deregistered


async def test_without_a_data_plane_prefix_hints_are_ignored_and_handoffs_refused(
        worker: WorkerService, bus: Bus, bus_config: BusConfig) -> None:
    from shared.errors import Unavailable as NoDataPlane
    from shared.schemas import KvTransferParams

    subject = bus_config.subjects.generate("w1")
    hinted = GenerateRequest(request_id="r-hint", model="tiny", token_ids=list(range(3, 40)),
                             sampling=SamplingParams(max_tokens=4),
                             kv_transfer=KvTransferParams(prefix_holder="w9", prefix_hashes=[1, 2]))
    tokens, finished = await whole_answer(bus, subject, hinted)  # computed here: the same answer
    assert len(tokens) == 4 and finished.pulled_tokens == 0
    held = msgspec.structs.replace(hinted, request_id="r-hold", kv_transfer=KvTransferParams(hold_for_decode=True))
    with pytest.raises(NoDataPlane, match="no KV data plane"):
        await whole_answer(bus, subject, held)
    members = await bus.key_value(bus_config.subjects.members_bucket)
    assert Codec(WorkerRegistration).decode((await members.get("w1")).value).kv_transfer is False


async def test_stop_after_the_nats_connection_closed_still_stops_everything(bus_config: BusConfig) -> None:
    own_bus = await connect(bus_config.nats_url, "test-worker-closed")
    config = WorkerConfig(worker_id="w-closed", bus=bus_config, kv_blocks=64, block_size=16,
                          membership=MembershipConfig(heartbeat_interval_s=0.1, ttl_s=1.0), load_interval_s=0.05)
    service = await start_sim_worker(config, own_bus, FAST)
    await own_bus.client.close()  # NATS gone for good: draining cannot re-register
    await asyncio.wait_for(service.stop(), 10)  # does not raise
    assert service.stopped.is_set()
    assert all(loop.done() for loop in service._loops), "a heartbeat or event loop still runs"


async def test_a_request_whose_caller_is_gone_is_cancelled_and_a_live_callers_is_not(
        bus: Bus, bus_config: BusConfig) -> None:
    """The caller's NATS connection closes mid-stream (a router SIGKILLed): the worker's next
    probe of its inbox gets "no responders" and cancels the request, long before
    `max_tokens`; a caller that is still there answers the probes and gets its whole answer."""
    config = WorkerConfig(worker_id="w-probe", bus=bus_config, kv_blocks=256, block_size=16,
                          caller_check_interval_s=0.2, membership=MembershipConfig(heartbeat_interval_s=0.1, ttl_s=1.0))
    service = await start_sim_worker(config, bus, SimEngineConfig(speedup=5))
    subject = bus_config.subjects.generate("w-probe")
    try:
        caller = await connect(bus_config.nats_url, "test-doomed-caller")
        stream = await open_stream(caller, subject, request("r-orphan", list(range(3, 60)), max_tokens=1900))
        await anext(stream.frames())  # running
        await caller.close()  # gone without a cancel
        await wait_for(lambda: service.inflight == 0, 5.0, "the orphaned request to be cancelled")
        assert service.callers.orphans_cancelled == 1 and service.engine.load().kv_used_blocks == 0

        started = time.monotonic()
        tokens, finished = await whole_answer(bus, subject, request("r-live", list(range(3, 60)), max_tokens=400))
        assert len(tokens) == 400 and finished.finish_reason == "length"
        inbox = await ResponseInbox(bus).open()  # the router's way: one subscription for all its streams
        shared = ResponseStream(bus, subject, accept_timeout_s=2.0, idle_timeout_s=10.0, inbox=inbox)
        await shared.send(encode(request("r-live-2", list(range(3, 60)), max_tokens=400)))
        assert len([t async for frame in shared.frames() for t in frame.token_ids]) == 400
        await shared.close()
        await inbox.close()
        assert time.monotonic() - started > 3 * config.caller_check_interval_s, "too short to be probed"
        assert service.callers.orphans_cancelled == 1
    finally:
        await service.stop()


class SlowStoppingEngine(SimEngine):
    """A sim engine whose stop waits until the test lets it finish."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stopping = asyncio.Event()
        self.may_stop = asyncio.Event()

    async def stop(self) -> None:
        self.stopping.set()
        await self.may_stop.wait()
        await super().stop()


async def test_a_heartbeat_while_the_engine_stops_does_not_register_the_worker_again(
        bus: Bus, bus_config: BusConfig) -> None:
    """A fleet's ticker heartbeats its workers from outside (`start(timers=False)`) until each
    has stopped; one that beats after the deregistration, while the engine still stops (slow
    on a loaded host), must not put the worker back in the members bucket for good."""
    config = WorkerConfig(worker_id="w-leaving", bus=bus_config, kv_blocks=64, block_size=16,
                          membership=MembershipConfig(heartbeat_interval_s=0.1, ttl_s=1.0))
    engine = SlowStoppingEngine(config, FAST, model_name="tiny", vocab_size=512)
    await engine.start()
    service = WorkerService(config, engine, bus)
    await service.start(timers=False)
    members = await bus.key_value(bus_config.subjects.members_bucket)
    await members.get("w-leaving")
    stopping = asyncio.create_task(service.stop())
    await asyncio.wait_for(engine.stopping.wait(), 5)  # deregistered, the engine not yet stopped
    await service.heartbeat()
    engine.may_stop.set()
    await asyncio.wait_for(stopping, 5)
    with pytest.raises(KeyNotFoundError):
        await members.get("w-leaving")
