"""The subject catalog: every NATS subject and bucket name Tandem uses, in one place.

A `namespace` prefixes everything so that several clusters (or several tests) share one
NATS server without seeing each other's traffic. Subjects carry the protocol version
(`v1`); a breaking change to a stream's schema gets a new version segment.
"""

from __future__ import annotations

import re

import msgspec

PROTOCOL_VERSION = "v1"
_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


def check_token(value: str, what: str) -> str:
    """A subject token must not contain '.', '*', '>' or whitespace."""
    if not _TOKEN.match(value):
        raise ValueError(f"{what} {value!r} must match [A-Za-z0-9_-]+")
    return value


class Subjects(msgspec.Struct, frozen=True):
    namespace: str = "tandem"

    def __post_init__(self) -> None:
        check_token(self.namespace, "namespace")

    @property
    def _root(self) -> str:
        return f"{self.namespace}.{PROTOCOL_VERSION}"

    # request plane: router -> worker; chunks come back on the caller's inbox
    def generate(self, worker_id: str) -> str:
        return f"{self._root}.worker.{check_token(worker_id, 'worker id')}.generate"

    # control plane: one subject per kind of control message (its tag: cancel, drain,
    # kv_snapshot, push_done), so that NATS permissions say who may send which
    def control(self, worker_id: str, kind: str) -> str:
        return f"{self._root}.ctl.{check_token(worker_id, 'worker id')}.{check_token(kind, 'control kind')}"

    def control_all(self, worker_id: str) -> str:
        return f"{self._root}.ctl.{check_token(worker_id, 'worker id')}.*"

    # event streams
    def kv_events(self, worker_id: str) -> str:
        return f"{self._root}.kv.events.{check_token(worker_id, 'worker id')}"

    @property
    def kv_events_all(self) -> str:
        return f"{self._root}.kv.events.*"

    # KV hand-off: leases and agent metadata (request/reply), transfer records
    def kv_lease(self, worker_id: str) -> str:
        return f"{self._root}.kv.lease.{check_token(worker_id, 'worker id')}"

    # a lease release from outside the workers (the router's "cancelled"): only releases
    def kv_release(self, worker_id: str) -> str:
        return f"{self._root}.kv.release.{check_token(worker_id, 'worker id')}"

    def kv_transfers(self, worker_id: str) -> str:
        return f"{self._root}.kv.transfers.{check_token(worker_id, 'worker id')}"

    @property
    def kv_transfers_all(self) -> str:
        return f"{self._root}.kv.transfers.*"

    def load(self, worker_id: str) -> str:
        return f"{self._root}.load.{check_token(worker_id, 'worker id')}"

    @property
    def load_all(self) -> str:
        return f"{self._root}.load.*"

    # routers sharing their predicted load (active-active replicas): one subject per router
    def router_load(self, router_id: str) -> str:
        return f"{self._root}.router.load.{check_token(router_id, 'router id')}"

    @property
    def router_load_all(self) -> str:
        return f"{self._root}.router.load.*"

    # orchestrator commands (request/reply): `OrchestratorCommand` in, `CommandOutcome` back
    @property
    def orchestrator_commands(self) -> str:
        return f"{self._root}.orchestrator.commands"

    # a router asking for a worker of a model that has none (`WakeModel` in, `CommandOutcome` back;
    # its own subject: a router may start a listed model's worker, never drain or remove one)
    @property
    def orchestrator_wake(self) -> str:
        return f"{self._root}.orchestrator.wake"

    # a long command's steps as they are done (`CommandProgress`, published by the orchestrator)
    @property
    def orchestrator_progress(self) -> str:
        return f"{self._root}.orchestrator.progress"

    @property
    def membership_changes(self) -> str:
        return f"{self._root}.membership.changes"

    @property
    def request_events(self) -> str:
        return f"{self._root}.requests.events"

    # the SLO planner's decisions (`PlannerDecision`), dry run or not
    @property
    def planner_decisions(self) -> str:
        return f"{self._root}.planner.decisions"

    # JetStream key-value bucket holding one registration per worker
    @property
    def members_bucket(self) -> str:
        return f"{self.namespace}_{PROTOCOL_VERSION}_members"

    # JetStream key-value bucket of the responses routers store (`/v1/responses`, `store`)
    @property
    def responses_bucket(self) -> str:
        return f"{self.namespace}_{PROTOCOL_VERSION}_responses"
