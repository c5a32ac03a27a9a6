"""The router's side of the bus towards workers (adapter): generate streams, cancels, and
lease releases. Both flows use it; the routing policy never sees it.

A lease release is a request/reply on the holder's `kv.release.<worker>` subject, bounded
by `lease_timeout_s`. Its result is a value: a holder that is unreachable (or already
let the lease go) is not an error for the request, only for the metrics; the holder's
lease TTL is the safety net then.
"""

from __future__ import annotations

import logging
from typing import Literal

from shared.bus import Bus
from shared.codec import Codec, MalformedCounter, encode
from shared.request_plane import ResponseInbox, ResponseStream
from shared.schemas import Cancel
from shared.schemas.transfer import KvHandle, LeaseAck, LeaseRelease, LeaseReply
from shared.subjects import Subjects

log = logging.getLogger(__name__)

# "released": the holder let the blocks go now; "already_ended": the reader (or expiry)
# was first; "unreachable": no answer in time, the holder's TTL frees the blocks.
LeaseReleaseResult = Literal["released", "already_ended", "unreachable"]


class WorkerLink:
    def __init__(self, bus: Bus, subjects: Subjects, malformed: MalformedCounter, *, accept_timeout_s: float,
                 idle_timeout_s: float, lease_timeout_s: float, inbox: ResponseInbox | None = None) -> None:
        self._bus = bus
        self._inbox = inbox  # open: every generate stream's frames arrive through it
        self._subjects = subjects
        self._lease_replies: Codec[LeaseReply] = Codec(LeaseReply, malformed)
        self._accept_timeout_s = accept_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._lease_timeout_s = lease_timeout_s

    def stream(self, worker_id: str) -> ResponseStream:
        """An unsent generate stream to `worker_id`; the caller sends it."""
        return ResponseStream(self._bus, self._subjects.generate(worker_id), accept_timeout_s=self._accept_timeout_s,
                              idle_timeout_s=self._idle_timeout_s, inbox=self._inbox)

    async def cancel(self, worker_id: str, request_id: str) -> None:
        try:
            await self._bus.client.publish(self._subjects.control(worker_id, "cancel"), encode(Cancel(request_id=request_id)))
        except Exception as error:  # NATS down: the worker notices its caller's inbox is gone
            log.warning("could not cancel %s on %s: %s", request_id, worker_id, error)

    async def release_lease(self, handle: KvHandle, headers: dict[str, str] | None = None) -> LeaseReleaseResult:
        """Tell the holder nobody will read `handle`'s blocks (outcome "cancelled"); `headers`
        carry the request's trace context to the holder."""
        subject = self._subjects.kv_release(handle.holder_worker_id)
        message = LeaseRelease(lease_id=handle.lease_id, outcome="cancelled")
        try:
            reply = await self._bus.client.request(subject, encode(message), timeout=self._lease_timeout_s,
                                                   headers=headers or None)
        except Exception as error:  # no responders, timeout, connection: the lease's TTL frees the blocks
            log.warning("could not release lease %s on %s: %s", handle.lease_id, handle.holder_worker_id, error)
            return "unreachable"
        ack = self._lease_replies.decode_or_none(reply.data, subject)
        if not isinstance(ack, LeaseAck):
            log.warning("unexpected answer to the release of lease %s: %r", handle.lease_id, ack)
            return "unreachable"
        return "released" if ack.ok else "already_ended"
