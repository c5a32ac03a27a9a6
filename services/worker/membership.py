"""A worker's entry in the members bucket: put at start, at every heartbeat, at once when
what it announces changes (`announce_soon`) and after a NATS reconnect (a restarted server
may have lost the bucket); deleted by `leave()`, after which nothing puts it back (neither
the worker's own timers nor a fleet's ticker calling its heartbeat while it stops).

One put or delete at a time, in order. The registration itself is the caller's to build
(`registration`, called at each put): this room only keeps it in the bucket.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from nats.js.kv import KeyValue

from shared.bus import Bus
from shared.codec import encode
from shared.errors import Disconnected
from shared.lifecycle import reraise_if_cancelling
from shared.schemas import WorkerRegistration

log = logging.getLogger(__name__)


class Membership:
    def __init__(self, bus: Bus, bucket: str, bucket_ttl_s: float, worker_id: str,
                 registration: Callable[[], WorkerRegistration]) -> None:
        self.bus = bus
        self.bucket = bucket
        self.bucket_ttl_s = bucket_ttl_s
        self.worker_id = worker_id
        self._registration = registration
        self._members: KeyValue | None = None
        self._lock = asyncio.Lock()  # one registration put or delete at a time, in order
        self._left = False  # deregistered (or deregistering): nothing registers it again
        self._announcements: set[asyncio.Task[None]] = set()

    @property
    def bound(self) -> bool:
        return self._members is not None

    async def bind(self) -> None:
        self._members = await self._bind()

    async def _bind(self) -> KeyValue:
        return await self.bus.key_value(self.bucket, ttl_s=self.bucket_ttl_s)

    async def put(self) -> None:
        """Put the registration now; a no-op once the worker left."""
        if not self.bus.client.is_connected:  # a KV put would wait out its timeout: the heartbeat after reconnecting carries it
            raise Disconnected("not connected to NATS")
        async with self._lock:
            if self._left:
                return
            value = encode(self._registration())
            try:
                await self._members.put(self.worker_id, value)
            except Exception:  # e.g. a restarted NATS lost the bucket: bind (re-create) and retry once
                self._members = await self._bind()
                await self._members.put(self.worker_id, value)

    async def put_quietly(self) -> None:
        """`put`, with a failure only logged: NATS gone, the next heartbeat carries it."""
        try:
            await self.put()
        except Exception as error:
            reraise_if_cancelling(error)
            log.debug("could not register %s: %s", self.worker_id, error)

    def announce_soon(self) -> None:
        """Register now rather than at the next heartbeat (what it holds changed)."""
        task = asyncio.create_task(self.put_quietly(), name="announce")
        self._announcements.add(task)
        task.add_done_callback(self._announcements.discard)

    def stop_putting(self) -> None:
        """From here no put registers the worker again; `leave()` deletes the entry."""
        self._left = True

    async def leave(self) -> None:
        """Delete the entry (after a put already under way, never before it). Raises when
        NATS is gone: the orchestrator's TTL removes the worker then."""
        self._left = True
        if not self.bus.client.is_connected:  # each call would wait out its timeout
            raise Disconnected("not connected to NATS")
        async with self._lock:
            if self._members is not None:
                await self._members.delete(self.worker_id)
