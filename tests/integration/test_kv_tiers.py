"""KV tiers end to end on the bus: a sim worker with a small KV pool and a host-memory tier
announces blocks it evicts to host memory, and those it loads back, and the router's KV view
(a real nats-server on a random port) keeps where each block is; a snapshot says the same."""

from __future__ import annotations

from services.router.kv.index import KvIndex
from services.router.kv.view import KvView
from services.worker.service import WorkerService
from services.worker.sim.config import SimEngineConfig
from services.worker.sim.engine import SimEngine
from shared.block_hash import block_hash_chain
from shared.bus import Bus
from shared.codec import Codec, MalformedCounter, encode
from shared.config import BusConfig, MembershipConfig, WorkerConfig
from shared.request_plane import open_stream
from shared.schemas import AllBlocksCleared, GenerateRequest, KvEventBatch, KvSnapshotRequest, SamplingParams
from tests.waiting import wait_for

BLOCK = 16
PROMPTS = [list(range(start, start + 8 * BLOCK)) for start in (1000, 3000)]  # 8 blocks each; the pool holds 12


async def generate(bus: Bus, bus_config: BusConfig, request_id: str, prompt: list[int]) -> int:
    """Run one request on w1; its cached prompt tokens."""
    request = GenerateRequest(request_id=request_id, model="tiny", token_ids=prompt,
                              sampling=SamplingParams(max_tokens=2))
    stream = await open_stream(bus, bus_config.subjects.generate("w1"), request)
    try:
        frames = [frame async for frame in stream.frames()]
    finally:
        await stream.close()
    assert [token for frame in frames for token in frame.token_ids] and stream.finished is not None
    return stream.finished.cached_tokens


async def test_tier_moves_reach_the_routers_index(bus: Bus, bus_config: BusConfig) -> None:
    config = WorkerConfig(worker_id="w1", bus=bus_config, kv_blocks=12, kv_host_blocks=32, block_size=BLOCK,
                          max_model_len=256, load_interval_s=0.05, kv_event_interval_s=0.01,
                          membership=MembershipConfig(heartbeat_interval_s=0.1, ttl_s=1.0))
    engine = SimEngine(config, SimEngineConfig(speedup=50), model_name="tiny", vocab_size=8192)
    await engine.start()
    worker = WorkerService(config, engine, bus)
    view = KvView(bus, bus_config.subjects, MalformedCounter())
    await view.start()
    view.worker_joined("w1", BLOCK, model="tiny")
    kv = view.model("tiny")
    batches: list[KvEventBatch] = []
    codec = Codec(KvEventBatch)

    async def keep(msg) -> None:
        batches.append(codec.decode(msg.data))

    await bus.client.subscribe(bus_config.subjects.kv_events("w1"), cb=keep)
    await worker.start()
    first, second = (block_hash_chain(prompt, BLOCK) for prompt in PROMPTS)
    try:
        await generate(bus, bus_config, "first", PROMPTS[0])
        await wait_for(lambda: kv.index.match(first) == {"w1": 8}, what="the first prompt indexed")
        await generate(bus, bus_config, "second", PROMPTS[1])  # evicts most of the first to host memory
        await wait_for(lambda: kv.index.match(second) == {"w1": 8} and len(kv.index.tiers("w1")) >= 4,
                       what="evicted blocks indexed in the host tier")
        moved = set(kv.index.tiers("w1"))
        assert moved <= set(first) and set(kv.index.tiers("w1").values()) == {"host"}
        assert kv.index.match(first) == {"w1": 8}  # still held, in host memory
        cache = kv.prompt_cache(PROMPTS[0] + [7], now=0.0)
        assert cache.tier_tokens == {"w1": {"host": len(moved) * BLOCK}} and cache.cached_tokens == {"w1": 8 * BLOCK}

        assert await generate(bus, bus_config, "again", PROMPTS[0]) == 8 * BLOCK - BLOCK  # loaded, not computed
        await wait_for(lambda: not set(kv.index.tiers("w1")) & set(first[:7]),
                       what="the loaded blocks back in the first tier")
        assert kv.index.tiers("w1") and set(kv.index.tiers("w1")) <= set(second)  # the second one's turn

        await bus.client.publish(bus_config.subjects.control("w1", "kv_snapshot"), encode(KvSnapshotRequest()))
        await wait_for(lambda: any(isinstance(event, AllBlocksCleared) for batch in batches for event in batch.events),
                       what="a snapshot")
        start = next(i for i, batch in enumerate(batches) if isinstance(batch.events[0], AllBlocksCleared))
        fresh = KvIndex(trust_chains=True)  # a router that sees only the snapshot
        fresh.add_worker("w1", BLOCK)
        await wait_for(lambda: sum(len(getattr(event, "block_hashes", ())) for batch in batches[start:]
                                   for event in batch.events) >= 16, what="the whole snapshot")
        for batch in batches[start:]:
            fresh.ingest(batch)
        assert dict(fresh.tiers("w1")) == dict(kv.index.tiers("w1"))
        assert fresh.match(first) == kv.index.match(first) and fresh.match(second) == kv.index.match(second)
    finally:
        await worker.stop()
        await engine.stop()
        await view.stop()
