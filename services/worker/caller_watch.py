"""Requests whose caller is gone are cancelled, not run to `max_tokens` for nobody.

A router that dies (SIGKILL, host lost) leaves its requests running on the workers: frames
are published to an inbox nobody reads. `CallerWatch.sweep()` asks, for every request
running longer than the interval, whether its caller's inbox still listens
(`FrameSender.caller_alive`); NATS answers "no responders" for a caller that is gone, and
that request is cancelled (its engine request aborted, its KV freed). No answer in time
means unknown: the request goes on and is asked again at the next sweep. The probe goes to
the request's own reply subject (one small request-reply per long request per interval).

Called by `WorkerService` on its timer (`WorkerConfig.caller_check_interval_s`); the requests
are tracked by `request_plane.RequestPlane` as it starts them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from shared.frame_sender import FrameSender

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0  # a busy caller may answer late: unknown, asked again next sweep


@dataclass(slots=True)
class _Watched:
    sender: FrameSender
    task: asyncio.Task[None]
    started: float


class CallerWatch:
    def __init__(self, worker_id: str, interval_s: float) -> None:
        self.worker_id = worker_id
        self.interval_s = interval_s
        self._watched: dict[str, _Watched] = {}
        self.orphans_cancelled = 0  # requests cancelled because their caller was gone

    def track(self, request_id: str, sender: FrameSender, task: asyncio.Task[None]) -> None:
        self._watched[request_id] = _Watched(sender, task, time.monotonic())
        task.add_done_callback(lambda _: self._watched.pop(request_id, None))

    async def sweep(self) -> None:
        """Cancel the requests, running longer than the interval, whose caller is gone."""
        now = time.monotonic()
        due = [(request_id, watched) for request_id, watched in self._watched.items()
               if now - watched.started >= self.interval_s and not watched.task.done()]
        if not due:
            return
        answers = await asyncio.gather(*(watched.sender.caller_alive(PROBE_TIMEOUT_S) for _, watched in due),
                                       return_exceptions=True)
        for (request_id, watched), alive in zip(due, answers):
            if alive is False and not watched.task.done():
                self.orphans_cancelled += 1
                log.info("worker %s: the caller of %s is gone: request cancelled", self.worker_id, request_id)
                watched.task.cancel()
