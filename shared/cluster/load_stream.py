"""Every worker's load snapshots (adapter), decoded, in order, stale ones dropped.

`LoadStream` subscribes to `Subjects.load_all` and calls `on_snapshot` with each
`LoadSnapshot` that is newer than the last one kept for its worker (`is_stale`: a
restarted worker starts `seq` over but not its clock, so a snapshot is stale only when
both its `seq` and its `ts` are not ahead). Malformed messages are counted in
`malformed`, logged once per subject, and dropped; stale ones are counted in `stale`.
A snapshot stamped more than `MAX_CLOCK_AHEAD_S` ahead of this process's clock is
implausible (a forged or broken one would otherwise make every real snapshot after it
look stale and freeze the worker's load): counted as malformed and dropped. So a
forged `seq` can hold a worker's view for at most that long.

The caller passes every `MemberEvent` to `on_member`: the stream keeps the last snapshot
of members only, and a worker that joins or restarts starts over (its first snapshot is
taken whatever its numbers). A snapshot from a non-member is handed on unchecked: the
caller drops it (or counts it) as it sees fit, and the stream keeps nothing of it.

`receive(data, subject)` is the message handler; tests call it with plain bytes, no bus.
Callers: the router's worker pool and the metrics collector.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared.bus import Bus, unsubscribe_quietly
from shared.cluster.member_events import MemberChange, MemberEvent
from shared.codec import Codec, MalformedCounter
from shared.schemas import LoadSnapshot
from shared.subjects import Subjects

MAX_CLOCK_AHEAD_S = 30.0  # clock skew between machines tolerated in a snapshot's `ts`


def is_stale(last: LoadSnapshot | None, snapshot: LoadSnapshot) -> bool:
    """Whether `snapshot` is a duplicate of, or older than, `last` (same worker)."""
    return last is not None and snapshot.seq <= last.seq and snapshot.ts <= last.ts


class LoadStream:
    def __init__(self, bus: Bus, subjects: Subjects, on_snapshot: Callable[[LoadSnapshot], None],
                 malformed: MalformedCounter, *, clock: Callable[[], float] = time.time) -> None:
        self._bus = bus
        self._clock = clock  # wall clock, as the workers' `ts`
        self._malformed = malformed
        self._subject = subjects.load_all
        self._on_snapshot = on_snapshot
        self._snapshots: Codec[LoadSnapshot] = Codec(LoadSnapshot, malformed)
        self._latest: dict[str, LoadSnapshot | None] = {}  # members only: None until one arrives
        self._subscription: Subscription | None = None
        self.stale = 0

    async def start(self) -> None:
        self._subscription = await self._bus.client.subscribe(self._subject, cb=self._on_message)

    async def stop(self) -> None:
        await unsubscribe_quietly([self._subscription], "load stream")
        self._subscription = None

    def on_member(self, event: MemberEvent) -> None:
        if event.change is MemberChange.LEFT:
            self._latest.pop(event.worker_id, None)
        elif event.change is not MemberChange.UPDATED:  # a new process: its numbers start over
            self._latest[event.worker_id] = None

    def receive(self, data: bytes, subject: str) -> None:
        snapshot = self._snapshots.decode_or_none(data, subject)
        if snapshot is None:
            return
        if not snapshot.ts <= self._clock() + MAX_CLOCK_AHEAD_S:  # NaN too
            self._malformed.record(subject, ValueError(f"timestamp {snapshot.ts} is implausibly far ahead"))
            return
        worker_id = snapshot.worker_id
        if worker_id in self._latest:
            if is_stale(self._latest[worker_id], snapshot):
                self.stale += 1
                return
            self._latest[worker_id] = snapshot
        self._on_snapshot(snapshot)

    async def _on_message(self, msg: Msg) -> None:
        self.receive(msg.data, msg.subject)
