"""Request plane over NATS: a request goes to a worker subject, and the worker streams
numbered frames back to the caller's private inbox.

Caller (`open_stream`) guarantees that every request ends in exactly one explicit way:
a `Finished` frame, or a raised `TandemError` — `Unavailable` (nobody accepted within the
accept timeout), `Timeout` (the worker went silent for the idle timeout), `StreamGap`
(a frame was lost), `Disconnected` (aborted from outside, e.g. the worker left the
cluster), or the worker's own `Failed` code. Never a silently truncated stream.

Worker (`FrameSender`, in `shared.frame_sender`) numbers frames from 0 so the caller can
detect gaps. A frame is never sent with a reply subject: a message that has one is a
worker's liveness probe (`FrameSender.caller_alive`), answered at once by the caller's inbox
and never queued. A caller that died has no inbox left, so NATS answers "no responders" and
the worker knows to stop generating for nobody.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator

import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared.bus import Bus
from shared.codec import Codec, encode
from shared.errors import Disconnected, StreamGap, TandemError, Timeout, Unavailable, from_code
from shared.schemas.generate import (
    Accepted,
    Failed,
    Finished,
    KvTarget,
    ResponseFrame,
    Tokens,
)
from shared.schemas.transfer import PushTarget

_frames: Codec[ResponseFrame] = Codec(ResponseFrame)
Arrival = Msg | TandemError  # a frame's message, or the error that ended the stream from outside


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class FrameQueue:
    """What arrived for one stream and waits to be read, for its one reader: every token
    passes through it, so it is a deque and at most one waiting future, with the wait's
    timeout a plain timer (no `asyncio.Queue` bookkeeping, no `asyncio.timeout` scope)."""

    __slots__ = ("_arrived", "_waiter")

    def __init__(self) -> None:
        self._arrived: deque[Arrival] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: Arrival) -> None:
        self._arrived.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def empty(self) -> bool:
        return not self._arrived

    async def get(self, timeout_s: float) -> Arrival:
        """The oldest arrival, waiting up to `timeout_s` for one (then `TimeoutError`)."""
        if not self._arrived:
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            timer = loop.call_later(timeout_s, _expire, waiter)
            try:
                await waiter
            finally:
                self._waiter = None
                timer.cancel()
                if waiter.done() and not waiter.cancelled():
                    waiter.exception()  # a timeout that a cancel overtook: read, so never logged as lost
        return self._arrived.popleft()


class ResponseInbox:
    """One subscription (`<inbox>.*`) that carries the frames of every stream of a caller
    opened with it, each stream under its own token: no subscribe and unsubscribe per
    request. `open()` before the first stream, `close()` at the end."""

    def __init__(self, bus: Bus) -> None:
        self._bus = bus
        self._prefix = ""
        self._sub: Subscription | None = None
        self._queues: dict[str, FrameQueue] = {}
        self._next_token = 0

    async def open(self) -> ResponseInbox:
        self._prefix = self._bus.client.new_inbox() + "."
        self._sub = await self._bus.client.subscribe(self._prefix + "*", cb=self._deliver)
        return self

    async def close(self) -> None:
        if self._sub is not None:
            await _unsubscribe(self._sub)
            self._sub = None

    def register(self, queue: FrameQueue) -> str:
        """The reply subject of a new stream whose frames go to `queue`."""
        assert self._sub is not None, "the inbox is not open"
        self._next_token += 1
        token = str(self._next_token)
        self._queues[token] = queue
        return self._prefix + token

    def unregister(self, reply: str) -> None:
        self._queues.pop(reply[len(self._prefix):], None)

    async def _deliver(self, msg: Msg) -> None:
        if msg.reply:
            await _answer_probe(msg)
            return
        queue = self._queues.get(msg.subject[len(self._prefix):])
        if queue is not None:  # a closed stream's late frame is dropped, as an unsubscribed one's
            queue.put(msg)


class ResponseStream:
    """The caller's side of one streamed request. Iterate to get frames. With an `inbox`,
    frames arrive through that shared subscription; else through one of the stream's own."""

    def __init__(self, bus: Bus, subject: str, *, accept_timeout_s: float, idle_timeout_s: float,
                 inbox: ResponseInbox | None = None) -> None:
        self._bus = bus
        self.subject = subject
        self._accept_timeout_s = accept_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._queue = FrameQueue()
        self._inbox = inbox
        self._reply = ""
        self._sub: Subscription | None = None
        self._next_seq = 0
        self.accepted: Accepted | None = None
        self.finished: Finished | None = None

    async def send(self, payload: bytes, headers: dict[str, str] | None = None) -> None:
        if self._inbox is not None:
            self._reply = self._inbox.register(self._queue)
            await self._bus.client.publish(self.subject, payload, reply=self._reply, headers=headers)
            return
        inbox = self._bus.client.new_inbox()
        self._sub = await self._bus.client.subscribe(inbox, cb=self._receive)
        await self._bus.client.publish(self.subject, payload, reply=inbox, headers=headers)

    async def _receive(self, msg: Msg) -> None:
        if msg.reply:
            await _answer_probe(msg)
        else:
            self._queue.put(msg)

    def abort(self, error: TandemError) -> None:
        """End the stream from outside (worker removed, client gone)."""
        self._queue.put(error)

    async def close(self) -> None:
        if self._inbox is not None and self._reply:
            self._inbox.unregister(self._reply)
            self._reply = ""
        if self._sub is not None:
            await _unsubscribe(self._sub)
            self._sub = None

    @property
    def frames_ready(self) -> bool:
        """Whether a frame (or the end) arrived and waits to be read: reading it does not wait."""
        return not self._queue.empty()

    async def _next_frame(self) -> ResponseFrame:
        first = self.accepted is None
        timeout = self._accept_timeout_s if first else self._idle_timeout_s
        try:
            item = await self._queue.get(timeout)  # a frame already here arms no timer
        except TimeoutError:
            if first:
                raise Unavailable(f"no worker accepted the request on {self.subject} within {timeout}s") from None
            raise Timeout(f"worker on {self.subject} was silent for {timeout}s") from None
        if isinstance(item, TandemError):
            raise item
        if item.headers and item.headers.get("Status") == "503":  # NATS "no responders"
            raise Unavailable(f"no worker is listening on {self.subject}")
        frame = _frames.decode_or_none(item.data, self.subject)
        if frame is None:
            raise StreamGap(f"malformed frame from {self.subject}")
        if frame.seq != self._next_seq:
            raise StreamGap(f"frame {self._next_seq} from {self.subject} was lost (got {frame.seq})")
        self._next_seq += 1
        return frame

    async def kv_target(self) -> PushTarget:
        """Push mode: the decode worker's target blocks, its first frame after `Accepted`."""
        while True:
            frame = await self._next_frame()
            match frame:
                case Accepted():
                    self.accepted = frame
                case KvTarget(target=target):
                    return target
                case Failed(code=code, message=message):
                    raise from_code(code, message)
                case _:
                    raise StreamGap(f"expected a KvTarget frame from {self.subject}, got {type(frame).__name__}")

    async def frames(self) -> AsyncIterator[Tokens]:
        """Yield token frames; return after `Finished` (kept in `.finished`); raise on failure."""
        while True:
            frame = await self._next_frame()
            match frame:
                case Accepted():
                    if self.accepted is not None:
                        raise StreamGap("duplicate Accepted frame")
                    self.accepted = frame
                case Tokens():
                    if self.accepted is None:
                        raise StreamGap("Tokens before Accepted")
                    yield frame
                case Finished():
                    self.finished = frame
                    return
                case Failed(code=code, message=message):
                    raise from_code(code, message)


async def _answer_probe(msg: Msg) -> None:
    try:
        await msg.respond(b"")
    except Exception:
        pass  # connection going away: the worker's probe times out and asks again later


async def _unsubscribe(subscription: Subscription) -> None:
    try:
        await subscription.unsubscribe()
    except Exception:
        pass  # connection already closed: nothing left to release


async def open_stream(
    bus: Bus,
    subject: str,
    request: msgspec.Struct,
    *,
    headers: dict[str, str] | None = None,
    accept_timeout_s: float = 2.0,
    idle_timeout_s: float = 60.0,
) -> ResponseStream:
    stream = ResponseStream(bus, subject, accept_timeout_s=accept_timeout_s, idle_timeout_s=idle_timeout_s)
    await stream.send(encode(request), headers)
    return stream


__all__ = ["ResponseInbox", "ResponseStream", "open_stream", "Disconnected"]
