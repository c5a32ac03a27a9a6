"""A worker's request plane: `generate.<worker>` requests, each run by a `RequestRunner` in
its own task, its frames streamed to the caller's inbox (`Accepted`, `Tokens`..., then
exactly one `Finished` or `Failed`; the frames are `shared.request_plane`'s). A request is
refused with a `Failed` frame when it is malformed, a duplicate of one in flight, or the
worker is draining; one without an inbox is dropped (nobody to answer).

The tasks in flight are this room's: `cancel` ends one (a `Cancel` control message), and
`finish` waits for all of them within a deadline, cancelling the rest (a drain or a stop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from nats.aio.msg import Msg

from services.worker.caller_watch import CallerWatch
from services.worker.request_runner import RequestRunner
from shared.bus import Bus
from shared.codec import Codec, MalformedCounter
from shared.errors import ErrorCode
from shared.frame_sender import FrameSender
from shared.schemas import GenerateRequest
from shared.tasks import finish_within


@dataclass(eq=False)
class RequestPlane:
    worker_id: str
    bus: Bus
    runner: RequestRunner
    callers: CallerWatch
    malformed: MalformedCounter
    draining: Callable[[], bool]
    _requests: Codec[GenerateRequest] = field(init=False)
    _inflight: dict[str, asyncio.Task[None]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._requests = Codec(GenerateRequest, self.malformed)

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    async def on_generate(self, msg: Msg) -> None:
        request = self._requests.decode_or_none(msg.data, msg.subject)
        if not msg.reply:
            return  # nobody to answer: a request without an inbox is dropped
        sender = FrameSender(self.bus, msg.reply)
        if request is None:
            await sender.failed(ErrorCode.INVALID_ARGUMENT.value, "malformed generate request")
            return
        if self.draining():
            await sender.failed(ErrorCode.UNAVAILABLE.value, f"worker {self.worker_id} is draining")
            return
        if request.request_id in self._inflight:
            await sender.failed(ErrorCode.INVALID_ARGUMENT.value, f"duplicate request id {request.request_id}")
            return
        task = asyncio.create_task(self.runner.run(request, sender, dict(msg.headers or {})),
                                   name=f"request:{request.request_id}")
        self._inflight[request.request_id] = task
        task.add_done_callback(lambda _: self._inflight.pop(request.request_id, None))
        self.callers.track(request.request_id, sender, task)

    def cancel(self, request_id: str) -> None:
        task = self._inflight.get(request_id)
        if task is not None:
            task.cancel()

    async def finish(self, deadline_s: float) -> None:
        """Wait for the requests in flight up to `deadline_s`; cancel those still running."""
        await finish_within(list(self._inflight.values()), deadline_s)
