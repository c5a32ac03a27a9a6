"""Sim workers with real engines, their KV data planes and the real holder and puller, on a
real NATS, over a KV transport the test names: what the KV hand-off tests share
(test_kv_handoff.py, test_kv_shapes.py). A worker may take another shape than the
default (block size, tensor- and pipeline-parallel degree)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest

from connector.nixl_agent import nixl_available
from connector.sim.transport_builder import build_rank_transports
from connector.sim.worker_kv import WorkerKv
from services.worker.service import WorkerService
from services.worker.sim.config import SimEngineConfig
from services.worker.sim.engine import SimEngine
from shared.bus import Bus
from shared.codec import Codec
from shared.config import BusConfig, KvTransferConfig, MembershipConfig, WorkerConfig
from shared.request_plane import open_stream
from shared.schemas import Finished, GenerateRequest, KvTransferParams, SamplingParams, TransferRecord
from tests.waiting import wait_for
from tests.worker_answers import whole_answer

BLOCK = 16
SIM = SimEngineConfig(speedup=50)  # the workers' sim

TRANSPORTS = [pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")),
              "memory"]


def worker_config(worker_id: str, bus_config: BusConfig, *, kv_blocks: int = 256, kv_host_blocks: int = 0,
                  shape: dict[str, int] | None = None, **kv) -> WorkerConfig:
    """`shape`: block_size, tensor_parallel, pipeline_parallel (default: 16-token blocks, 1, 1)."""
    return WorkerConfig(worker_id=worker_id, bus=bus_config, kv_blocks=kv_blocks, kv_host_blocks=kv_host_blocks,
                        **{"block_size": BLOCK, **(shape or {})},
                        membership=MembershipConfig(heartbeat_interval_s=0.1, ttl_s=1.0),
                        load_interval_s=0.05, kv_event_interval_s=0.01, kv_transfer=KvTransferConfig(**kv))


async def start_worker(config: WorkerConfig, bus: Bus, *, model: str = "tiny", sim: SimEngineConfig = SIM) -> WorkerService:
    engine = SimEngine(config, sim, model_name=model, vocab_size=512)
    await engine.start()
    kv = WorkerKv(config, bus, engine, build_rank_transports(config, engine), compat_hash=engine.info.compat_hash)
    service = WorkerService(config, engine, bus, kv)
    await service.start()
    return service


class Cluster:
    def __init__(self, bus: Bus, bus_config: BusConfig, transport: str) -> None:
        self.bus = bus
        self.bus_config = bus_config
        self.transport = transport
        self.workers: dict[str, WorkerService] = {}
        self.records: list[TransferRecord] = []

    def config(self, worker_id: str, *, kv_blocks: int = 256, kv_host_blocks: int = 0,
               shape: dict[str, int] | None = None, **kv) -> WorkerConfig:
        return worker_config(worker_id, self.bus_config, kv_blocks=kv_blocks, kv_host_blocks=kv_host_blocks,
                             shape=shape, transport=self.transport, **kv)

    async def add(self, worker_id: str, *, model: str = "tiny", kv_blocks: int = 256, kv_host_blocks: int = 0,
                  shape: dict[str, int] | None = None, **kv) -> WorkerService:
        config = self.config(worker_id, kv_blocks=kv_blocks, kv_host_blocks=kv_host_blocks, shape=shape, **kv)
        service = await start_worker(config, self.bus, model=model)
        self.workers[worker_id] = service
        return service

    async def generate(self, worker_id: str, prompt: list[int], max_tokens: int,
                       kv: KvTransferParams | None = None, model: str = "tiny") -> tuple[list[int], Finished]:
        request = GenerateRequest(request_id=f"r{time.monotonic_ns()}", model=model, token_ids=prompt,
                                  sampling=SamplingParams(max_tokens=max_tokens), kv_transfer=kv)
        return await whole_answer(self.bus, self.bus_config.subjects.generate(worker_id), request)

    async def disaggregated(self, prefill: str, decode: str, prompt: list[int], max_tokens: int
                            ) -> tuple[list[int], Finished, Finished]:
        first, p_done = await self.generate(prefill, prompt, 1, KvTransferParams(hold_for_decode=True))
        rest, d_done = await self.generate(decode, prompt + first, max_tokens - 1,
                                           KvTransferParams(source=p_done.kv_handle))
        return first + rest, p_done, d_done

    async def disaggregated_prompts(self, max_tokens: int) -> list[Finished]:
        """Every prompt of `prompts()` on worker "single", then pulled from "prefill" by
        "decode": the same answers. The decode worker's `Finished` of each."""
        finished = []
        for prompt in prompts():
            expected, _ = await self.generate("single", prompt, max_tokens)
            got, _, d_done = await self.disaggregated("prefill", "decode", prompt, max_tokens)
            assert got == expected, f"prompt of {len(prompt)} tokens"
            finished.append(d_done)
        return finished

    async def assert_clean(self, timeout_s: float = 5.0) -> None:
        await wait_for(lambda: all(w.kv.active_leases == 0 and w.engine.load().kv_used_blocks == 0
                                   and w.inflight == 0 for w in self.workers.values()),
                       timeout_s, "no leases, no used blocks")




async def transport_cluster(bus: Bus, bus_config: BusConfig, transport: str) -> AsyncIterator[Cluster]:
    """A cluster recording every transfer record; its workers stop at the end."""
    nodes = Cluster(bus, bus_config, transport)
    codec: Codec[TransferRecord] = Codec(TransferRecord)

    async def on_record(msg) -> None:
        nodes.records.append(codec.decode(msg.data))

    await bus.client.subscribe(bus_config.subjects.kv_transfers_all, cb=on_record)
    yield nodes
    for worker in nodes.workers.values():
        await worker.stop()


def prompts() -> list[list[int]]:
    lengths = [5, 15, 16, 17, 32, 48, 63, 64, 100, 200]
    return [[3 + (i * 7 + n) % 500 for i in range(n)] for n in lengths]


async def push_disaggregated(cluster: Cluster, prefill: str, decode: str, prompt: list[int], max_tokens: int
                             ) -> tuple[list[int], Finished]:
    """Push mode, driven as the router drives it: decode first (it allocates), then prefill."""
    subjects = cluster.bus_config.subjects
    decode_request = GenerateRequest(request_id=f"d{time.monotonic_ns()}", model="tiny", token_ids=prompt,
                                     sampling=SamplingParams(max_tokens=max_tokens - 1),
                                     kv_transfer=KvTransferParams(await_push=True))
    decode_stream = await open_stream(cluster.bus, subjects.generate(decode), decode_request)
    target = await decode_stream.kv_target()
    first, p_done = await cluster.generate(prefill, prompt, 1, KvTransferParams(push_to=target))
    try:
        rest = [t async for frame in decode_stream.frames() for t in frame.token_ids]
    finally:
        await decode_stream.close()
    assert p_done.finish_reason in ("length", "stop")
    return first + rest, decode_stream.finished
