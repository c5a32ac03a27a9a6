"""The members bucket as typed events (adapter): `WorkerRegistration`s in, `MemberEvent`s out.

`MembershipMirror` mirrors `Subjects.members_bucket` with a `BucketMirror` (so its watcher
is recreated after every reconnect), decodes each value, and calls `on_event` with a
`MemberEvent` (joined / updated / restarted / left, see `member_events`). `members` holds
the current registration of every worker in the bucket.

A value that does not decode, a registration stored under another worker's key, or a key
that is not a valid worker id (a subject token) is counted in `malformed`, logged once
per key, and dropped: the worker keeps its last good registration. A delete of a key
that never held a good one is no event.

With a `grace_s` (the routers pass the bucket's TTL), a worker missing from the bucket
after a reconnect stays a member for that long (a restarted server's memory-stored
bucket comes back empty until the workers put their registrations back), but is listed
in `unconfirmed` until its registration is seen again, or `confirm(worker_id)` is called
with other proof that it is alive: callers route no new work to it meanwhile.

`apply(key, value)` is the bucket callback; tests call it with plain bytes, no bus.
Callers: the router's worker pool, the metrics collector, the orchestrator.
"""

from __future__ import annotations

from collections.abc import Callable

from nats.js.kv import KeyValue

from shared.bus import Bus
from shared.cluster.bucket_mirror import BucketMirror
from shared.cluster.member_events import MemberChange, MemberEvent, member_change
from shared.codec import Codec, MalformedCounter
from shared.schemas import WorkerRegistration
from shared.subjects import check_token


class MembershipMirror:
    def __init__(self, bus: Bus, bucket: str, on_event: Callable[[MemberEvent], None],
                 malformed: MalformedCounter, *, ttl_s: float | None = None,
                 grace_s: float | None = None) -> None:
        self._bucket = bucket
        self._on_event = on_event
        self._registrations: Codec[WorkerRegistration] = Codec(WorkerRegistration, malformed)
        self._malformed = malformed
        self.members: dict[str, WorkerRegistration] = {}
        self._mirror = BucketMirror(bus, bucket, self.apply, ttl_s=ttl_s, grace_s=grace_s)

    @property
    def kv(self) -> KeyValue | None:
        """The bucket itself (bound by `start()`), for a caller that writes to it."""
        return self._mirror.kv

    @property
    def unconfirmed(self) -> set[str]:
        """Members not seen in the bucket since the last reconnect (with a grace only)."""
        return self._mirror.unconfirmed

    def confirm(self, worker_id: str) -> bool:
        """`worker_id` showed it is alive since the reconnect (its load report came in): no
        longer unconfirmed; whether it was."""
        return worker_id in self._mirror.unconfirmed and self._mirror.confirm(worker_id)

    async def start(self) -> None:
        """Returns once the bucket's current members have been reported."""
        await self._mirror.start()

    async def stop(self) -> None:
        await self._mirror.stop()

    def apply(self, key: str, value: bytes | None) -> None:
        """One change of the bucket: a put's value, or None for a delete."""
        if value is None:
            registration = self.members.pop(key, None)
            if registration is not None:
                self._on_event(MemberEvent(MemberChange.LEFT, key, registration))
            return
        registration = self._decode(key, value)
        if registration is None:
            return
        previous = self.members.get(key)
        self.members[key] = registration
        self._on_event(MemberEvent(member_change(previous, registration), key, registration, previous))

    def _decode(self, key: str, value: bytes) -> WorkerRegistration | None:
        subject = f"{self._bucket}.{key}"
        registration = self._registrations.decode_or_none(value, subject)
        if registration is None:
            return None
        try:
            check_token(key, "worker id")  # bucket keys may hold '.', which a worker id may not
        except ValueError as error:
            self._malformed.record(subject, error)
            return None
        if registration.worker_id != key:
            self._malformed.record(subject, ValueError(f"registration for {registration.worker_id!r} "
                                                       f"stored under key {key!r}"))
            return None
        return registration
