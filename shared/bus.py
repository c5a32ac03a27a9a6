"""NATS connection helpers used by every service.

- `connect()` returns a `Bus`: a connected client with an `error_cb` (without one, every
  reconnect attempt prints a traceback), unlimited reconnects, and hooks run on disconnect
  and on reconnect.

A key-value bucket mirrored across reconnects is `shared.cluster.bucket_mirror.BucketMirror`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BadRequestError, BucketNotFoundError
from nats.js.kv import KeyValue

log = logging.getLogger(__name__)

Hook = Callable[[], Awaitable[None]]


class Bus:
    def __init__(self, client: Client, name: str) -> None:
        self.client = client
        self.name = name
        self.js: JetStreamContext = client.jetstream()
        self._reconnect_hooks: list[Hook] = []
        self._disconnect_hooks: list[Callable[[], None]] = []

    def on_reconnect(self, hook: Hook) -> None:
        self._reconnect_hooks.append(hook)

    def on_disconnect(self, hook: Callable[[], None]) -> None:
        """`hook` runs (synchronously) when the connection drops, before any reconnect."""
        self._disconnect_hooks.append(hook)

    def _disconnected(self) -> None:
        log.info("%s disconnected from NATS", self.name)
        for hook in list(self._disconnect_hooks):
            try:
                hook()
            except Exception:
                log.exception("%s: disconnect hook failed", self.name)

    async def _reconnected(self) -> None:
        log.info("%s reconnected to NATS", self.name)
        for hook in list(self._reconnect_hooks):
            try:
                await hook()
            except Exception:  # a failing hook must not stop the others or reconnection
                log.exception("%s: reconnect hook failed", self.name)

    async def key_value(self, bucket: str, *, ttl_s: float | None = None) -> KeyValue:
        """Bind to a bucket, creating it (memory storage, one value per key) if absent."""
        try:
            return await self.js.key_value(bucket)
        except BucketNotFoundError:
            config = KeyValueConfig(bucket=bucket, history=1, storage=StorageType.MEMORY,
                                    ttl=ttl_s)
            try:
                return await self.js.create_key_value(config)
            except BadRequestError:
                # another client created it first (after a server restart everyone races
                # to re-create it, possibly with another TTL): use theirs
                return await self.js.key_value(bucket)

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        if not self.client.is_closed:
            try:
                await asyncio.wait_for(self.client.drain(), 5.0)
            except Exception:
                await self.client.close()


async def connect(url: str, name: str, *, connect_timeout_s: float = 5.0) -> Bus:
    bus: Bus | None = None

    async def error_cb(error: Exception) -> None:
        log.warning("%s: NATS error: %s", name, error)

    async def disconnected_cb() -> None:
        if bus is not None:
            bus._disconnected()

    async def reconnected_cb() -> None:
        if bus is not None:
            await bus._reconnected()

    client = await nats.connect(
        url,
        name=name,
        error_cb=error_cb,
        disconnected_cb=disconnected_cb,
        reconnected_cb=reconnected_cb,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.2,
        connect_timeout=connect_timeout_s,
        allow_reconnect=True,
    )
    bus = Bus(client, name)
    return bus

