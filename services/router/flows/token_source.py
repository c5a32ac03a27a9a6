"""What a `Generation` reads a request's tokens from, and its one-worker implementation.

A `TokenSource` yields `Tokens` frames and keeps the request's `Finished` once it ended;
`cancel()` tells whichever worker is still working to stop, and `close()` releases
everything the source holds (streams, in-flight slots, leases), always, exactly once.

- `WorkerPart`: one generate request on one worker. A single-worker plan is one part; a
  disaggregated plan is two (`services.router.flows.two_part`); the flow executor
  (`services.router.flows.executor`) builds them.
- `Answered`: no worker at all; the request is over before it starts (the decode-first
  cache-hit threshold was not met, or a resumed request had nothing left to generate).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

import msgspec
from nats.errors import Error as NatsError

from services.router.fleet.worker_link import WorkerLink
from services.router.fleet.worker_state import InFlight
from shared.codec import encode
from shared.errors import InvalidArgument, TandemError, Unavailable
from shared.schemas import Finished, Tokens
from shared.schemas.transfer import PushTarget


class TokenSource(Protocol):
    @property
    def worker_id(self) -> str:
        """The worker serving the request now: the one re-routing avoids and records name."""
        ...

    @property
    def finished(self) -> Finished | None: ...

    @property
    def failed_worker_id(self) -> str | None:
        """The worker whose failure ended `frames()` with an error; None while none did."""
        ...

    def frames(self) -> AsyncIterator[Tokens]:
        """Token frames; returns once `finished` is set; raises `TandemError` on failure."""
        ...

    @property
    def frames_ready(self) -> bool:
        """Whether the next step of `frames()` would not wait (a frame, the end or a failure
        is already here): the caller may take it into the same piece of output."""
        ...

    async def cancel(self) -> None: ...

    async def close(self) -> None: ...


class WorkerPart:
    """One generate request on one worker: its stream, its in-flight slot, its cancel.

    The stream exists (and is aborted if its worker leaves) before the request is sent,
    so a part can always be closed, even if sending was interrupted.
    """

    def __init__(self, link: WorkerLink, in_flight: InFlight, request_id: str) -> None:
        self._link = link
        self._in_flight = in_flight
        self.request_id = request_id
        self._stream = link.stream(in_flight.worker_id)
        self.failed_worker_id: str | None = None
        in_flight.attach(self._stream)

    @property
    def worker_id(self) -> str:
        return self._in_flight.worker_id

    @property
    def accepted(self) -> bool:
        return self._stream.accepted is not None

    @property
    def finished(self) -> Finished | None:
        return self._stream.finished

    @property
    def frames_ready(self) -> bool:
        return self._stream.frames_ready

    async def send(self, request: msgspec.Struct, headers: dict[str, str]) -> None:
        """Raises `InvalidArgument` when the request cannot be encoded (validation should have
        refused it: the client's input, not the cluster), `Unavailable` when it could not be
        sent (NATS down)."""
        try:
            payload = encode(request)
        except (msgspec.EncodeError, OverflowError, UnicodeEncodeError, TypeError) as error:
            raise InvalidArgument(f"the request cannot be encoded for the workers: {error}") from error
        try:
            await self._stream.send(payload, headers)
        except (OSError, asyncio.TimeoutError, NatsError) as error:
            raise Unavailable(f"could not send the request to {self.worker_id}: {error}") from error

    async def kv_target(self) -> PushTarget:
        """Push mode: the blocks the (decode) worker allocated for the writer."""
        try:
            return await self._stream.kv_target()
        except TandemError:
            self.failed_worker_id = self.worker_id
            raise

    async def frames(self) -> AsyncIterator[Tokens]:
        try:
            async for frame in self._stream.frames():
                if frame.token_ids:
                    self._in_flight.prefill_done()  # its prompt no longer waits for prefill
                yield frame
        except TandemError:
            self.failed_worker_id = self.worker_id
            raise

    async def cancel(self) -> None:
        """A no-op on the worker if it already ended the request."""
        await self._link.cancel(self.worker_id, self.request_id)

    async def close(self) -> None:
        """Idempotent: unsubscribe and give the worker's in-flight slot back."""
        try:
            await self._stream.close()
        finally:
            self._in_flight.end()


class Answered:
    """A request answered without any worker: `frames()` yields nothing, `finished` is set."""

    frames_ready = False

    def __init__(self, finished: Finished) -> None:
        self.finished: Finished | None = finished
        self.failed_worker_id: str | None = None

    @property
    def worker_id(self) -> str:
        return ""

    async def frames(self) -> AsyncIterator[Tokens]:
        return
        yield  # an async generator that yields nothing

    async def cancel(self) -> None:
        pass

    async def close(self) -> None:
        pass
