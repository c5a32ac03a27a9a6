"""One measured phase against one system: `count` streaming completions, `concurrency` at a
time (closed loop) or sent at `rate_rps` a second, evenly spaced, at most `concurrency` in
flight (open loop: every system is offered the same load), through the serving bench's
client (`bench.serve.client`), and the router processes' CPU time over the phase (Linux
/proc: user + system, all threads).

Every request opens a fresh connection, for both systems: Dynamo's HTTP server leaves
Nagle's algorithm on, so a kept-alive connection would add ~40 ms to its answers
(`bench.routing.dynamo.dynamo_client`); the same client for both keeps the comparison about
the routers. With several router processes, requests go to them in turn.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass

from bench.router.systems import RouterSystem
from bench.routing.dynamo import dynamo_client
from bench.serve.client import RequestShape, stream_request
from bench.serve.stats import RequestRecord

REQUEST_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class Phase:
    name: str  # "concurrent" or "sequential"
    count: int
    concurrency: int  # in flight (closed loop); the most in flight (open loop)
    max_tokens: int
    rate_rps: float = 0.0  # > 0: open loop, requests sent a second


@dataclass(frozen=True, slots=True)
class PhaseRun:
    """What the client saw and what the routers spent."""

    records: tuple[RequestRecord, ...]
    duration_s: float
    router_cpu_s: float


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` so far (every thread); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def prompts(count: int, offset: int = 0) -> list[str]:
    """Short, distinct prompts (a few words: some ten tokens)."""
    return [f"Request {offset + index}: say something short about the number {index % 97}."
            for index in range(count)]


async def run_phase(system: RouterSystem, phase: Phase, offset: int = 0) -> PhaseRun:
    shape = RequestShape(api="completions", model=system.model, max_tokens=phase.max_tokens,
                         timeout_s=REQUEST_TIMEOUT_S, ignore_eos=True)
    async with AsyncExitStack() as exits:
        clients = [await exits.enter_async_context(dynamo_client(url, REQUEST_TIMEOUT_S)) for url in system.base_urls]
        turn = itertools.cycle(clients)
        pending = iter(prompts(phase.count, offset))
        records: list[RequestRecord] = []

        async def send(prompt: str) -> None:
            record = RequestRecord(sent_at=time.monotonic())
            records.append(record)
            await stream_request(next(turn), shape, prompt, record)

        async def lane() -> None:
            for prompt in pending:
                await send(prompt)

        async def arrivals() -> None:
            """Open loop: one request every 1 / rate seconds; one due while `concurrency` are in
            flight waits for a slot (the run then reports fewer requests/s than offered)."""
            slots = asyncio.Semaphore(phase.concurrency)

            async def one(prompt: str) -> None:
                try:
                    await send(prompt)
                finally:
                    slots.release()

            sending: list[asyncio.Task[None]] = []
            for index, prompt in enumerate(pending):
                await asyncio.sleep(max(0.0, started + index / phase.rate_rps - time.monotonic()))
                await slots.acquire()
                sending.append(asyncio.create_task(one(prompt)))
            await asyncio.gather(*sending)

        cpu_before = sum(process_cpu_s(pid) for pid in system.router_pids)
        started = time.monotonic()
        if phase.rate_rps > 0:
            await arrivals()
        else:
            await asyncio.gather(*(lane() for _ in range(min(phase.concurrency, phase.count))))
        duration_s = time.monotonic() - started
        cpu_s = sum(process_cpu_s(pid) for pid in system.router_pids) - cpu_before
    return PhaseRun(records=tuple(records), duration_s=duration_s, router_cpu_s=cpu_s)
