"""What the vLLM stack tests watch: load reports and transfer records off the bus, and
the one way they ask the router for a completion."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import openai

from launch.stack import LocalStack
from shared.bus import Bus, connect
from shared.codec import Codec
from shared.schemas import TransferRecord
from shared.subjects import Subjects
from tests.e2e.conftest import LoadWatcher

ALWAYS_DISAGGREGATE = ("--local-prefill-tokens", "0")  # short prompts too: these tests are about the hand-off
WORKERS = ("p1", "d1")
# Leases far longer than any wait below: every lease must end by an explicit release, and a
# request that waited for one to time out would fail the test rather than pass slowly.
LONG_LEASES = ("--kv-lease-ttl", "120")


class Observer:
    """Load snapshots and transfer records of one stack, straight off the bus."""

    def __init__(self, bus: Bus, namespace: str) -> None:
        self.bus = bus
        self.subjects = Subjects(namespace)
        self.loads = LoadWatcher()
        self.records: list[TransferRecord] = []

    async def start(self) -> None:
        await self.loads.start(self.bus, self.subjects.load_all)
        codec: Codec[TransferRecord] = Codec(TransferRecord)

        async def on_record(msg) -> None:
            record = codec.decode_or_none(msg.data, msg.subject)
            if record is not None:
                self.records.append(record)

        await self.bus.client.subscribe(self.subjects.kv_transfers_all, cb=on_record)

    def counter(self, worker_id: str, name: str) -> int:
        return getattr(self.loads.latest[worker_id], name)

    async def settled(self, worker_id: str, name: str) -> int:
        """A cumulative counter once two load reports in a row agree (they come every 0.25 s)."""
        last = self.counter(worker_id, name)
        while True:
            await asyncio.sleep(0.6)
            now = self.counter(worker_id, name)
            if now == last:
                return now
            last = now

    async def assert_clean(self) -> None:
        """No request, used block or lease left on any worker (within 20 s, far below the
        lease TTL: leases were released, not left to expire)."""
        await self.loads.wait_idle(list(WORKERS), timeout_s=20)
        deadline = time.monotonic() + 20
        while any(self.loads.latest[w].active_leases for w in WORKERS):
            assert time.monotonic() < deadline, f"leases left: {self.loads.latest}"
            await asyncio.sleep(0.1)


async def complete(client: openai.AsyncOpenAI, model: str, prompt: list[int], max_tokens: int) -> str:
    reply = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == max_tokens
    return reply.choices[0].text


@asynccontextmanager
async def observing(stack: LocalStack) -> AsyncIterator[Observer]:
    """An `Observer` of the stack, once every worker has reported its load."""
    bus = await connect(stack.nats_url, "vllm-test-observer")
    try:
        watcher = Observer(bus, stack.config.namespace)
        await watcher.start()
        deadline = time.monotonic() + 10
        while not all(w in watcher.loads.latest for w in WORKERS):
            assert time.monotonic() < deadline, "no load reports from the workers"
            await asyncio.sleep(0.05)
        yield watcher
    finally:
        await bus.close()
