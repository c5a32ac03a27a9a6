"""The membership table: which workers are alive, by the heartbeats the orchestrator sees.

Pure and synchronous; the caller passes `now` (a monotonic clock reading taken when a
heartbeat arrived) so liveness never depends on the workers' wall clocks. Every state
change appends a `MembershipChange` to a buffer that the adapter drains with
`take_changes()` and publishes in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shared.cluster.member_events import MemberChange, member_change
from shared.schemas import MembershipChange, WorkerRegistration

ChangeKind = Literal["joined", "updated", "removed"]


@dataclass
class Member:
    registration: WorkerRegistration
    last_seen: float


class MembershipTable:
    def __init__(self, ttl_s: float) -> None:
        assert ttl_s > 0
        self.ttl_s = ttl_s
        self._members: dict[str, Member] = {}
        self._changes: list[MembershipChange] = []

    @property
    def members(self) -> dict[str, WorkerRegistration]:
        return {worker_id: member.registration for worker_id, member in self._members.items()}

    def last_seen(self, worker_id: str) -> float | None:
        member = self._members.get(worker_id)
        return None if member is None else member.last_seen

    def observe(self, registration: WorkerRegistration, now: float) -> None:
        """A heartbeat: the worker's current registration, seen at `now`."""
        worker_id = registration.worker_id
        known = self._members.get(worker_id)
        self._members[worker_id] = Member(registration, now)
        previous = None if known is None else known.registration
        if previous is None:
            self._emit("joined", worker_id, "registered", registration)
        elif member_change(previous, registration) is MemberChange.RESTARTED:
            # Same id, new process: its KV cache and in-flight work are gone, so consumers
            # must see it leave and come back rather than a mere update.
            self._emit("removed", worker_id, "restarted", previous)
            self._emit("joined", worker_id, "registered", registration)
        elif previous.status != registration.status:
            self._emit("updated", worker_id, registration.status.value, registration)
        elif previous.role != registration.role:
            self._emit("updated", worker_id, "role_changed", registration)

    def forget(self, worker_id: str, now: float) -> None:
        """The worker removed its own registration (a clean shutdown).

        `now` is unused today; it keeps every transition's signature alike for callers.
        """
        member = self._members.pop(worker_id, None)
        if member is not None:
            self._emit("removed", worker_id, "deregistered", member.registration)

    def restart_ttls(self, now: float) -> None:
        """The observer was blind until `now` (disconnected from NATS): silence it could
        not hear is no evidence of death, so every member's TTL starts again from `now`."""
        for member in self._members.values():
            member.last_seen = max(member.last_seen, now)

    def sweep(self, now: float) -> list[MembershipChange]:
        """Remove workers unseen for `ttl_s`; returns those removals (also buffered).

        The adapter uses the returned list to delete the workers' keys from the bucket.
        """
        expired = [worker_id for worker_id, member in self._members.items()
                   if now - member.last_seen > self.ttl_s]
        removed: list[MembershipChange] = []
        for worker_id in expired:
            member = self._members.pop(worker_id)
            removed.append(self._emit("removed", worker_id, "heartbeat_lost", member.registration))
        return removed

    def take_changes(self) -> list[MembershipChange]:
        changes, self._changes = self._changes, []
        return changes

    def _emit(self, kind: ChangeKind, worker_id: str, reason: str,
              registration: WorkerRegistration) -> MembershipChange:
        change = MembershipChange(kind=kind, worker_id=worker_id, reason=reason,
                                  registration=registration)
        self._changes.append(change)
        return change
