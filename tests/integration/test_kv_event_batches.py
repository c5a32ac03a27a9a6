"""KV events larger than one NATS message (a snapshot of a large cache) go out in several
batches, numbered on without a gap, against a real nats-server whose `max_payload` is small;
a router's KV index fed the parts holds what one batch would have given."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from services.router.kv.index import KvIndex
from services.worker.service import WorkerService
from services.worker.sim.config import SimEngineConfig
from services.worker.sim.engine import SimEngine
from shared.block_hash import block_hash_chain
from shared.bus import Bus, connect
from shared.codec import Codec, encode
from shared.config import BusConfig, MembershipConfig, WorkerConfig
from shared.nats_server import EmbeddedNats
from shared.request_plane import open_stream
from shared.schemas import AllBlocksCleared, GenerateRequest, KvEventBatch, KvSnapshotRequest, SamplingParams
from tests.waiting import wait_for

MAX_PAYLOAD = 6144
# Two prompts of ~3 KB each (token ids of 3 bytes): each request fits one message, a snapshot
# of both (~8 KB of events with their token ids and hashes) does not
PROMPTS = (list(range(1000, 2000)), list(range(3000, 4000)))


@pytest.fixture
def small_nats(tmp_path: Path) -> Iterator[EmbeddedNats]:
    config = tmp_path / "nats.conf"
    config.write_text(f"max_payload: {MAX_PAYLOAD}\n")
    with EmbeddedNats(str(tmp_path / "js"), config_file=str(config)) as server:
        yield server


@pytest.fixture
async def small_bus(small_nats: EmbeddedNats) -> AsyncIterator[tuple[Bus, BusConfig]]:
    config = BusConfig(nats_url=small_nats.url, namespace="batches")
    async with await connect(config.nats_url, "test-client") as bus:
        assert bus.client.max_payload == MAX_PAYLOAD
        yield bus, config


async def test_a_large_snapshot_goes_out_in_parts_that_rebuild_the_index(small_bus: tuple[Bus, BusConfig]) -> None:
    bus, bus_config = small_bus
    config = WorkerConfig(worker_id="w1", bus=bus_config, kv_blocks=512, block_size=16,
                          membership=MembershipConfig(heartbeat_interval_s=0.1, ttl_s=1.0),
                          load_interval_s=0.05, kv_event_interval_s=0.01)
    engine = SimEngine(config, SimEngineConfig(speedup=50), model_name="tiny", vocab_size=4096)
    await engine.start()
    worker = WorkerService(config, engine, bus)
    sizes: list[int] = []
    batches: list[KvEventBatch] = []
    codec = Codec(KvEventBatch)

    async def keep(msg) -> None:
        sizes.append(len(msg.data))
        batches.append(codec.decode(msg.data))

    subjects = bus_config.subjects
    await bus.client.subscribe(subjects.kv_events("w1"), cb=keep)
    await worker.start()
    try:
        for number, prompt in enumerate(PROMPTS):
            request = GenerateRequest(request_id=f"r{number}", model="tiny", token_ids=prompt,
                                      sampling=SamplingParams(max_tokens=2))
            stream = await open_stream(bus, subjects.generate("w1"), request)
            try:
                assert [t async for frame in stream.frames() for t in frame.token_ids]
            finally:
                await stream.close()
        chain = [h for prompt in PROMPTS for h in block_hash_chain(prompt, 16)]
        await wait_for(lambda: len({h for b in batches for e in b.events for h in getattr(e, "block_hashes", ())}
                                   & set(chain)) == len(chain), what="the prompts' blocks announced")

        await bus.client.publish(subjects.control("w1", "kv_snapshot"), encode(KvSnapshotRequest()))
        await wait_for(lambda: any(isinstance(e, AllBlocksCleared) for b in batches for e in b.events),
                       what="a snapshot")
        snapshot_at = next(i for i, b in enumerate(batches) if isinstance(b.events[0], AllBlocksCleared))
        await wait_for(lambda: len({h for b in batches[snapshot_at:] for e in b.events
                                    for h in getattr(e, "block_hashes", ())} & set(chain)) == len(chain),
                       what="the whole snapshot")
        assert len(batches) - snapshot_at > 1, "the snapshot fit one message"
        assert max(sizes) <= MAX_PAYLOAD
        assert [b.seq for b in batches] == list(range(1, len(batches) + 1)), "no gap, no repeat"

        fresh = KvIndex()  # a router that only sees the snapshot's parts, in order
        fresh.add_worker("w1", 16)
        for batch in batches[snapshot_at:]:
            assert not fresh.ingest(batch).resync_needed
        for prompt in PROMPTS:
            own = block_hash_chain(prompt, 16)
            assert fresh.match(own) == {"w1": len(own)}
    finally:
        await worker.stop()
        await engine.stop()
