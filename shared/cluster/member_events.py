"""What a change in the members bucket means for a worker. Pure.

A worker puts its `WorkerRegistration` under its id every heartbeat and deletes it on a
clean shutdown. Compared with the registration known before, a put is:
- JOINED: no registration was known under that id;
- RESTARTED: a new `started_at`: same id, new process; its KV cache, its event streams
  and its in-flight work are gone, so consumers treat it as a leave and a join;
- UPDATED: the same process again: a heartbeat, or a change of status or role.
A delete (or an expiry the orchestrator turned into one) is LEFT.

Callers: `MembershipMirror` (which emits `MemberEvent`s to the router, the metrics
collector and the orchestrator) and the orchestrator's `MembershipTable`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from shared.schemas import WorkerRegistration


class MemberChange(str, Enum):
    JOINED = "joined"
    UPDATED = "updated"
    RESTARTED = "restarted"
    LEFT = "left"


@dataclass(frozen=True, slots=True)
class MemberEvent:
    change: MemberChange
    worker_id: str
    registration: WorkerRegistration  # the current one; for LEFT, the last one known
    previous: WorkerRegistration | None = None  # the one it replaces (UPDATED, RESTARTED)


def member_change(previous: WorkerRegistration | None, current: WorkerRegistration) -> MemberChange:
    """A put of `current` where `previous` was known (None: nothing was)."""
    if previous is None:
        return MemberChange.JOINED
    if previous.started_at != current.started_at:
        return MemberChange.RESTARTED
    return MemberChange.UPDATED
