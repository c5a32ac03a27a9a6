"""One measured phase against one system: `count` streaming completions, `concurrency` at a
time (closed loop), through the serving bench's client (`bench.serve.client`), and the
router processes' CPU time over the phase (Linux /proc: user + system, all threads).

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
    concurrency: int
    max_tokens: int


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

        async def lane() -> None:
            for prompt in pending:
                record = RequestRecord(sent_at=time.monotonic())
                records.append(record)
                await stream_request(next(turn), shape, prompt, record)

        cpu_before = sum(process_cpu_s(pid) for pid in system.router_pids)
        started = time.monotonic()
        await asyncio.gather(*(lane() for _ in range(min(phase.concurrency, phase.count))))
        duration_s = time.monotonic() - started
        cpu_s = sum(process_cpu_s(pid) for pid in system.router_pids) - cpu_before
    return PhaseRun(records=tuple(records), duration_s=duration_s, router_cpu_s=cpu_s)
