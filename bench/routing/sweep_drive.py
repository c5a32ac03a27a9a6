"""One sweep point driven against one running system: warm-up, then open-loop sessions at
their arrival times or closed-loop users, then the row's figures.

Warm-up (not measured): one request per tenant, so every shared prefix is cached somewhere.
Open loop: each session starts at its offset and sends its turns one after the other (a
later turn after its think time); every request is measured. Closed loop: `users` lanes, each
running sessions back to back; the first cycle is a ramp (not measured), then requests sent
during `duration_s` are. Every request goes through the arm's `RequestRouting` (the oracle
arm's pin header). Latency figures come from the client (`RunLog`); cache, eviction and
balance figures from the system's counters, when it has them. Called by `bench.routing.sweep`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

from bench.routing.arms import RequestRouting
from bench.routing.client import finish, progress, stream_completion
from bench.routing.counters import Counters, settled, sweep_figures
from bench.routing.family import (
    PointSizing,
    Session,
    SessionMaker,
    SweepPoint,
    lane_session,
    open_sessions,
    warmup_sessions,
)
from bench.routing.systems import System
from bench.routing.workloads import EngineShape, Outcome, RunLog

LANE_SESSIONS = 100_000  # more than any lane gets through


@dataclass(frozen=True)
class PointRun:
    point: SweepPoint
    shape: EngineShape
    sizing: PointSizing
    vocab_size: int
    seed: int
    duration_s: float
    drain_s: float


class SessionPlayer:
    """Sends sessions' turns in order through one client, logging measured outcomes."""

    def __init__(self, client: httpx.AsyncClient, model: str, routing: RequestRouting) -> None:
        self.client, self.model, self.routing = client, model, routing
        self.log = RunLog()

    async def play(self, session: Session, *, measured_from: float = 0.0, stop_at: float = float("inf"),
                   wait_first: bool = True) -> None:
        try:
            for index, turn in enumerate(session.turns):
                if turn.think_s and (index or wait_first):
                    if time.monotonic() + turn.think_s >= stop_at:
                        return
                    await asyncio.sleep(turn.think_s)
                outcome = Outcome(sent_at=time.monotonic())
                if outcome.sent_at >= stop_at:
                    return
                if outcome.sent_at >= measured_from:
                    self.log.outcomes.append(outcome)
                headers, worker = self.routing.begin(session.group)
                try:
                    await stream_completion(self.client, self.model, turn.prompt, turn.max_tokens, outcome,
                                            headers=headers)
                finally:
                    self.routing.end(worker)
                if outcome.error is not None:
                    return  # the conversation is lost
        finally:
            self.routing.session_ended(session.group)


async def _warm_up(player: SessionPlayer, run: PointRun) -> None:
    gate = asyncio.Semaphore(run.shape.workers)
    sessions = warmup_sessions(run.point, run.vocab_size, run.seed)
    warm = SessionPlayer(player.client, player.model, player.routing)

    async def one(session: Session) -> None:
        async with gate:
            await warm.play(session)

    await asyncio.gather(*(one(session) for session in sessions))
    failed = sum(outcome.error is not None for outcome in warm.log.outcomes)
    if failed:
        progress(f"  warm-up: {failed} of {len(sessions)} requests failed")


async def _open_loop(player: SessionPlayer, run: PointRun) -> list[asyncio.Task]:
    tasks: list[asyncio.Task] = []
    start = time.monotonic()
    for session in open_sessions(run.point, run.shape, run.sizing, run.vocab_size, run.seed, run.duration_s):
        delay = start + session.start_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(player.play(session)))
    return tasks


async def drive_point(system: System, run: PointRun, routing: RequestRouting) -> dict:
    """Run the point against `system`; the row's figures."""
    async with system.client(system.base_url) as client, httpx.AsyncClient() as http:
        player = SessionPlayer(client, system.model, routing)
        if run.point.tenants:
            await _warm_up(player, run)
        before: Counters | None = None
        if not run.point.closed_loop:
            before = await settled(http, system.counters) if system.counters else None
            tasks = await _open_loop(player, run)
        else:
            maker = SessionMaker(run.point, run.shape, run.vocab_size, run.seed)
            window_start = time.monotonic() + run.sizing.cycle_s
            window_end = window_start + run.duration_s

            async def lane(number: int) -> None:
                for index in range(LANE_SESSIONS):
                    if time.monotonic() >= window_end:
                        return
                    await player.play(lane_session(maker, number, index), measured_from=window_start,
                                      stop_at=window_end)

            tasks = [asyncio.create_task(lane(number)) for number in range(run.sizing.users)]
            await asyncio.sleep(max(0.0, window_start - time.monotonic()))
            before = await system.counters(http) if system.counters else None
            await asyncio.sleep(max(0.0, window_end - time.monotonic()))
        await finish(tasks, run.drain_s)
        after = await settled(http, system.counters) if system.counters else None
    figures = player.log.summary()
    if before is not None and after is not None:
        figures.update(sweep_figures(before, after))
    return figures
