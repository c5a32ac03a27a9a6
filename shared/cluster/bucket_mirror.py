"""A local mirror of a JetStream key-value bucket, kept current across NATS reconnects.

`BucketMirror` reports every change as (key, value-or-None) to one callback, and keeps the
current values in `values`. Its watcher is recreated after every reconnect, because an
existing JetStream watcher stalls for ~18 s after a server restart; the fresh watcher's
initial values are diffed against the mirror so no put or delete is missed. A failing
callback is logged and does not stop the watcher.

Callers: `MembershipMirror` (the members bucket, typed); anything that needs a raw bucket.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from shared.bus import Bus
from shared.lifecycle import reraise_if_cancelling

log = logging.getLogger(__name__)

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
