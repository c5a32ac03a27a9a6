"""A local mirror of a JetStream key-value bucket, kept current across NATS reconnects.

`BucketMirror` reports every change as (key, value-or-None) to one callback, and keeps the
current values in `values`. Its watcher is recreated after every reconnect, because an
existing JetStream watcher stalls for ~18 s after a server restart; the fresh watcher's
initial values are diffed against the mirror so no put or delete is missed. A failing
callback is logged (one line) and does not stop the watcher.

With a `grace_s`, a disconnect makes every key *unconfirmed* (`unconfirmed`) until the
fresh watcher sees it again, and a key missing from the fresh watcher's initial values is
removed only if it is still missing `grace_s` later: a restarted server comes back with an
empty memory-stored bucket, and live workers put their registrations back on reconnect
and every heartbeat, so the mirror must not report them gone meanwhile. Without a grace,
a missing key is removed at once.

On a NATS cluster the bucket outlives the server a client was on, but a fresh watcher
waits for the bucket's leader, and the server lost may have been that leader (seconds of
election). So after a reconnect each unconfirmed key is also read directly (any replica
answers), again and again until the fresh watcher has synced: a key still there is
confirmed at once. A caller with its own proof that a key is current confirms it with
`confirm(key)` (the router: a load report from the worker, sent since the reconnect).

Callers: `MembershipMirror` (the members bucket, typed); anything that needs a raw bucket.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from nats.js.errors import NotFoundError
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from shared.bus import Bus
from shared.lifecycle import reraise_if_cancelling

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 1.0  # a direct read after a reconnect gives up this soon...
READ_RETRY_S = 0.25  # ...and is tried again this much later

Change = Callable[[str, bytes | None], None]


class BucketMirror:
    """A local mirror of a KV bucket, kept current across NATS reconnects."""

    def __init__(self, bus: Bus, bucket: str, on_change: Change, *, ttl_s: float | None = None,
                 grace_s: float | None = None) -> None:
        self._bus = bus
        self._grace_s = grace_s
        self.unconfirmed: set[str] = set()  # keys not seen since the last reconnect
        self._removals: dict[str, asyncio.TimerHandle] = {}
        self._bucket_name = bucket
        self._ttl_s = ttl_s
        self._on_change = on_change
        self.values: dict[str, bytes] = {}
        self._task: asyncio.Task[None] | None = None
        self._reads: asyncio.Task[None] | None = None  # confirming keys by direct reads
        self._synced = asyncio.Event()
        self.kv: KeyValue | None = None

    async def start(self) -> None:
        self.kv = await self._bus.key_value(self._bucket_name, ttl_s=self._ttl_s)
        self._bus.on_disconnect(self._unconfirm)
        self._bus.on_reconnect(self._rewatch)
        self._task = asyncio.create_task(self._watch(), name=f"watch:{self._bucket_name}")
        await asyncio.wait_for(self._synced.wait(), 10.0)

    async def stop(self) -> None:
        self._cancel_removals()
        if self._reads is not None:
            self._reads.cancel()
            await asyncio.gather(self._reads, return_exceptions=True)
        await self._stop_watcher()

    async def _stop_watcher(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def _unconfirm(self) -> None:
        if self._grace_s is not None:
            self.unconfirmed = set(self.values)  # until the fresh watcher sees them again

    async def _rewatch(self) -> None:
        self._unconfirm()
        await self._stop_watcher()
        self._synced.clear()
        self._task = asyncio.create_task(self._watch(), name=f"watch:{self._bucket_name}")
        if self._reads is not None:
            self._reads.cancel()  # it read the keys of the reconnect before
        if self.unconfirmed:
            self._reads = asyncio.create_task(self._confirm_by_reads(), name=f"confirm:{self._bucket_name}")

    async def _confirm_by_reads(self) -> None:
        """Reads each unconfirmed key directly, again every `READ_RETRY_S` while it is
        unconfirmed and the fresh watcher has not synced: just after a reconnect a read may
        go unanswered (the cluster is still noticing the server it lost)."""
        kv = self.kv
        if kv is None:
            return

        def pending(key: str) -> bool:
            return key in self.unconfirmed and not self._synced.is_set()

        async def read(key: str) -> None:
            failures = 0
            while pending(key):
                try:
                    entry = await asyncio.wait_for(kv.get(key), READ_TIMEOUT_S)
                except asyncio.CancelledError:
                    raise
                except NotFoundError:  # deleted or never there: the fresh watcher decides
                    return
                except Exception as error:  # no answer yet
                    reraise_if_cancelling(error)
                    failures += 1
                    if failures == 1:
                        log.info("bucket %s: direct read of %s after a reconnect failed (%r); retrying",
                                 self._bucket_name, key, error)
                    await asyncio.sleep(READ_RETRY_S)
                    continue
                # the watcher may have seen it meanwhile, with a newer value: it had the last word
                if entry.value is not None and pending(key) and self.confirm(key):
                    self.values[key] = entry.value
                    self._emit(key, entry.value)
                return

        await asyncio.gather(*(read(key) for key in list(self.unconfirmed)))

    def confirm(self, key: str) -> bool:
        """`key` is current (the watcher or a direct read saw it, or the caller has its own
        proof, e.g. a live worker's load report): confirmed, its pending removal called off;
        whether it was unconfirmed."""
        removal = self._removals.pop(key, None)
        if removal is not None:
            removal.cancel()
        if key in self.unconfirmed:
            self.unconfirmed.discard(key)
            return True
        return False

    def _cancel_removals(self) -> None:
        for removal in self._removals.values():
            removal.cancel()
        self._removals.clear()

    def _remove_missing(self, key: str) -> None:
        """A key the fresh watcher did not see: gone now, or after the grace if it is not put back."""
        if self._grace_s is None:
            del self.values[key]
            self._emit(key, None)
        elif key not in self._removals:
            self._removals[key] = asyncio.get_running_loop().call_later(self._grace_s, self._expire, key)

    def _expire(self, key: str) -> None:
        self._removals.pop(key, None)
        self.unconfirmed.discard(key)
        if self.values.pop(key, None) is not None:
            log.warning("bucket %s: %s was not put back within %gs of a reconnect: removed",
                        self._bucket_name, key, self._grace_s)
            self._emit(key, None)

    def _emit(self, key: str, value: bytes | None) -> None:
        try:
            self._on_change(key, value)
        except Exception as error:  # one line: a hostile value must not fill the log with tracebacks
            log.error("bucket %s: change handler failed for %s: %r", self._bucket_name, key, error)

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
                            self._remove_missing(key)
                        for key, value in initial.items():
                            # a confirmed key is reported even unchanged: its readers may wait for it
                            if self.confirm(key) | (self.values.get(key) != value):
                                self.values[key] = value
                                self._emit(key, value)
                        self._synced.set()
                        continue
                    deleted = entry.operation in (KV_DEL, KV_PURGE)
                    if in_initial:
                        if not deleted:
                            initial[entry.key] = entry.value
                        continue
                    self.confirm(entry.key)
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
                log.warning("bucket %s watcher failed: %r; retrying", self._bucket_name, error)
                await asyncio.sleep(0.5)
