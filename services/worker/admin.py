"""A worker's admin state in force: its role and status, changed by `SetRole`, `Cordon`,
`Uncordon` and `Drain` (the pure rules are `admin_state`'s) and announced at once, not at
the next heartbeat. A role switch keeps the engine and its prefix cache: what was taken in
the old role (requests, held KV leases) runs to its end, and the reason says how much.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from services.worker import admin_state
from services.worker.admin_state import AdminState
from services.worker.membership import Membership
from shared.lifecycle import reraise_if_cancelling
from shared.schemas import WorkerRole, WorkerStatus
from shared.schemas.control import ControlOutcome

log = logging.getLogger(__name__)


class Admin:
    def __init__(self, worker_id: str, role: WorkerRole, membership: Membership,
                 work_in_hand: Callable[[], tuple[int, int]]) -> None:
        self.worker_id = worker_id
        self.state = AdminState(role=role)
        self._membership = membership
        self._work_in_hand = work_in_hand  # () -> (requests in flight, KV leases held)

    @property
    def role(self) -> WorkerRole:
        return self.state.role

    @property
    def status(self) -> WorkerStatus:
        return self.state.status

    @property
    def draining(self) -> bool:
        return self.state.status is WorkerStatus.DRAINING

    async def apply(self, message: admin_state.AdminMessage) -> tuple[ControlOutcome, str]:
        """Change role or status, and announce it at once."""
        transition = admin_state.apply(self.state, message)
        if transition.outcome != "applied":
            return transition.outcome, transition.reason
        previous, self.state = self.state, transition.state
        reason = ""
        if previous.role is not self.state.role:
            requests, leases = self._work_in_hand()
            reason = (f"{previous.role.value} -> {self.state.role.value}, engine and cache kept; "
                      f"{requests} request(s) in flight and {leases} KV lease(s) held run to their end")
            log.info("worker %s switches role: %s", self.worker_id, reason)
        try:
            await self._membership.put()
        except Exception as error:  # NATS gone: the next heartbeat carries it
            reraise_if_cancelling(error)
            log.warning("%s could not announce %s: %s", self.worker_id, type(message).__name__, error)
            return "applied", f"not announced yet: {error}"
        return "applied", reason
