"""NATS connection helpers used by every service.

- `connect()` returns a `Bus`: a connected client with an `error_cb` (without one, every
  reconnect attempt prints a traceback), unlimited reconnects, and hooks run on reconnect.
- `BucketMirror` keeps a local copy of a JetStream key-value bucket and reports changes
  as (key, value-or-None). Its watcher is recreated after every reconnect, because an
  existing JetStream watcher stalls for ~18 s after a server restart; the fresh watcher's
  initial values are diffed against the mirror so no put or delete is missed.
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
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from shared.lifecycle import reraise_if_cancelling

log = logging.getLogger(__name__)

Hook = Callable[[], Awaitable[None]]


class Bus:
    def __init__(self, client: Client, name: str) -> None:
        self.client = client
        self.name = name
        self.js: JetStreamContext = client.jetstream()
        self._reconnect_hooks: list[Hook] = []

    def on_reconnect(self, hook: Hook) -> None:
        self._reconnect_hooks.append(hook)

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
        log.info("%s disconnected from NATS", name)

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


Change = Callable[[str, bytes | None], None]


class BucketMirror:
    """A local mirror of a KV bucket, kept current across NATS reconnects."""

    def __init__(self, bus: Bus, bucket: str, on_change: Change, *, ttl_s: float | None = None) -> None:
        self._bus = bus
        self._bucket_name = bucket
        self._ttl_s = ttl_s
        self._on_change = on_change
        self.values: dict[str, bytes] = {}
        self._task: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()
        self.kv: KeyValue | None = None

    async def start(self) -> None:
        self.kv = await self._bus.key_value(self._bucket_name, ttl_s=self._ttl_s)
        self._bus.on_reconnect(self._rewatch)
        self._task = asyncio.create_task(self._watch(), name=f"watch:{self._bucket_name}")
        await asyncio.wait_for(self._synced.wait(), 10.0)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _rewatch(self) -> None:
        await self.stop()
        self._synced.clear()
        self._task = asyncio.create_task(self._watch(), name=f"watch:{self._bucket_name}")

    def _emit(self, key: str, value: bytes | None) -> None:
        try:
            self._on_change(key, value)
        except Exception:
            log.exception("bucket %s: change handler failed for %s", self._bucket_name, key)

    async def _watch(self) -> None:
        while True:
            try:
                # re-bind every time: a restarted server may have lost a memory-stored bucket
                self.kv = await self._bus.key_value(self._bucket_name, ttl_s=self._ttl_s)
                watcher = await self.kv.watchall()
                initial: dict[str, bytes] = {}
                in_initial = True
                async for entry in watcher:
                    if entry is None:  # end of the initial values: reconcile with the mirror
                        in_initial = False
                        for key in [k for k in self.values if k not in initial]:
                            del self.values[key]
                            self._emit(key, None)
                        for key, value in initial.items():
                            if self.values.get(key) != value:
                                self.values[key] = value
                                self._emit(key, value)
                        self._synced.set()
                        continue
                    deleted = entry.operation in (KV_DEL, KV_PURGE)
                    if in_initial:
                        if not deleted:
                            initial[entry.key] = entry.value
                        continue
                    if deleted:
                        if self.values.pop(entry.key, None) is not None:
                            self._emit(entry.key, None)
                    else:
                        self.values[entry.key] = entry.value
                        self._emit(entry.key, entry.value)
                return
            except asyncio.CancelledError:
                raise
            except Exception as error:  # server gone: the reconnect hook starts a fresh watcher
                reraise_if_cancelling(error)
                log.warning("bucket %s watcher failed: %s; retrying", self._bucket_name, error)
                await asyncio.sleep(0.5)
