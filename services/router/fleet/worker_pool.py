"""The router's view of the workers (adapter): membership, load, and its own in-flight work.

- Membership mirrors the JetStream bucket `Subjects.members_bucket` (`MembershipMirror`
  recreates its watcher after a reconnect). A worker that left is gone: every
  stream this router has open on it is aborted with `Disconnected` at once, so the client
  gets an explicit error now rather than after the idle timeout. A registration with a new
  `started_at` is a restarted worker: streams on the old incarnation are aborted as well.
- A NATS reconnect (the server restarted, or the link dropped) may have lost frames of
  every open stream: each one is aborted at once with `Reconnected`, so its `Generation`
  resumes it (or ends it with an explicit error) instead of waiting for the idle timeout.
  While disconnected and for `RESYNC_WAIT_S` after the reconnect, a resumed request may
  wait for a worker (`resync_wait_s`).
  A worker missing from the bucket after the reconnect is kept for `reconnect_grace_s` (a
  restarted server's bucket is empty until the workers put their registrations back) but
  is not routed to (`views()`) until its registration is seen again or a load snapshot of
  it arrives (on a NATS cluster the bucket's fresh watcher may wait seconds for a leader
  election; a worker that reports its load is alive and on the bus).
- Load comes from `LoadSnapshot`s on `Subjects.load_all` (`LoadStream` drops stale ones).
- `begin()` counts a request against its worker from the moment it is routed until
  `InFlight.end()`, and the uncached prompt tokens it brings until its first token
  (`InFlight.prefill_done()`), in the worker's predicted-load ledger
  (`services.router.routing.ledger.WorkerLoad`, pure); the policy sees both through `views()`.
  `InFlight` and each member's `WorkerState` (its view included) live in `worker_state`.
- Other routers serving the same cluster (replicas behind one address) share theirs
  (`SharedLoadLink`): their requests in flight and prompt tokens waiting for prefill on a
  worker are added to this router's own in `views()`, and a load snapshot records them
  too (what it already counts), as for our own; the prompts they routed go to the
  `on_peer_prediction` the pool was built with.

Malformed bucket values and snapshots are counted, logged once, and dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Sequence
from typing import Protocol

from services.router.fleet.shared_load_link import PeerPrediction, SharedLoadLink
from services.router.fleet.worker_state import InFlight, WorkerState, kv_pool_tokens
from services.router.routing.view import WorkerView
from shared.bus import Bus
from shared.cluster.load_stream import LoadStream
from shared.cluster.member_events import MemberChange, MemberEvent
from shared.cluster.membership_mirror import MembershipMirror
from shared.codec import MalformedCounter
from shared.errors import Disconnected, Reconnected
from shared.schemas import LoadSnapshot, RoutedLoad, WorkerStatus
from shared.subjects import Subjects

log = logging.getLogger(__name__)

RESYNC_WAIT_S = 3.0  # after a reconnect, how long a resumed request may wait for its workers to re-register


class MembershipListener(Protocol):
    def worker_joined(self, worker_id: str, block_size: int, kv_tokens: int = 0, *, model: str,
                      lends_host_tier: bool = False) -> None: ...

    def worker_left(self, worker_id: str) -> None: ...


class WorkerPool:
    def __init__(self, bus: Bus, subjects: Subjects, malformed: MalformedCounter, *,
                 bucket_ttl_s: float | None = None, reconnect_grace_s: float | None = None,
                 listeners: Sequence[MembershipListener] = (), on_peer_prediction: PeerPrediction | None = None) -> None:
        self._listeners = listeners  # told when a worker joins (or restarts) and leaves
        # `on_peer_prediction`: told each prompt another router routed (`SharedLoadLink`)
        self.shared_load = SharedLoadLink(bus, subjects, malformed, self._own_load,
                                          on_peer_prediction=on_peer_prediction)
        self._workers: dict[str, WorkerState] = {}
        self._bus = bus
        self._members = MembershipMirror(bus, subjects.members_bucket, self._on_member, malformed,
                                         ttl_s=bucket_ttl_s, grace_s=reconnect_grace_s)
        self._reconnected_at: float | None = None
        self._disconnected = False
        self._loads = LoadStream(bus, subjects, self._on_load, malformed)
        self._routed = 0  # routing sequence number, for the policy's round-robin tie-break
        self._changed = asyncio.Event()

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        await self._loads.start()
        await self._members.start()  # its reconnect hook (unconfirm every member) runs before ours
        await self.shared_load.start()
        self._bus.on_disconnect(self._on_disconnect)
        self._bus.on_reconnect(self._reconnected)

    async def stop(self) -> None:
        await self.shared_load.stop()
        await self._members.stop()
        await self._loads.stop()
        for state in self._workers.values():
            state.abort_all(Disconnected("the router is shutting down"))

    # ---- what the policy and the serving layer read ----------------------------------

    def views(self, worker_ids: Collection[str] | None = None) -> list[WorkerView]:
        """Members that can be routed to: not those unconfirmed since a reconnect; only those
        among `worker_ids` when given (unknown ids skipped)."""
        unconfirmed, remote = self._members.unconfirmed, self.shared_load.remote
        if worker_ids is None:
            return [state.view(remote(worker_id)) for worker_id, state in self._workers.items()
                    if worker_id not in unconfirmed]
        states = ((worker_id, self._workers.get(worker_id)) for worker_id in worker_ids)
        return [state.view(remote(worker_id)) for worker_id, state in states
                if state is not None and worker_id not in unconfirmed]

    def is_active(self, worker_id: str) -> bool:
        """Whether `worker_id` is a member whose registration says ACTIVE."""
        state = self._workers.get(worker_id)
        return state is not None and state.registration.status is WorkerStatus.ACTIVE

    def member_ids(self) -> list[str]:
        """Every member's id, routable or not (cheap: no views built)."""
        return list(self._workers)

    def resync_wait_s(self) -> float:
        """How long a resumed request may still wait for a worker: while NATS is disconnected
        and for `RESYNC_WAIT_S` after the reconnect (the workers re-register meanwhile)."""
        if self._disconnected:
            return RESYNC_WAIT_S
        if self._reconnected_at is None:
            return 0.0
        return max(0.0, self._reconnected_at + RESYNC_WAIT_S - time.monotonic())

    @property
    def worker_ids(self) -> list[str]:
        return sorted(self._workers)

    @property
    def models(self) -> list[str]:
        return sorted({state.registration.model for state in self._workers.values()})

    def models_holding(self, adapter: str) -> list[str]:
        """The models some of whose workers hold a LoRA adapter named `adapter`, sorted."""
        return sorted({state.registration.model for state in self._workers.values()
                       if adapter in state.registration.adapters})

    def moves_adapter_kv(self, model: str) -> bool:
        """Whether every worker of `model` moves the KV of requests served with an adapter."""
        return all(state.registration.capabilities.adapter_kv_transfer for state in self._workers.values()
                   if state.registration.model == model)

    def model_dirs(self, model: str) -> list[str]:
        """The model directories `model`'s workers registered (where its tokenizer is), sorted."""
        return sorted({state.registration.model_dir for state in self._workers.values()
                       if state.registration.model == model and state.registration.model_dir})

    @property
    def in_flight(self) -> int:
        """Requests routed and not yet ended (a disaggregated one may hold two workers)."""
        return len({request_id for state in self._workers.values() for request_id in state.in_flight})

    def __len__(self) -> int:
        return len(self._workers)

    async def wait_for_change(self, timeout_s: float) -> None:
        """Return when membership changes, or after `timeout_s`."""
        changed = self._changed
        try:
            await asyncio.wait_for(changed.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass

    def begin(self, worker_id: str, request_id: str, *, prefill_tokens: int = 0, decodes: bool = True) -> InFlight:
        """Count a request (and the uncached prompt tokens it brings) against `worker_id`;
        call right after the policy chose it. `decodes` false: only its prompt is computed
        there, for another worker."""
        state = self._workers[worker_id]
        self._routed += 1
        in_flight = InFlight(self, worker_id, request_id, prefill_tokens, decodes=decodes)
        state.route(in_flight, self._routed)
        self.shared_load.changed(worker_id)
        return in_flight

    def _prefill_done(self, in_flight: InFlight) -> None:
        state = self._workers.get(in_flight.worker_id)
        if state is not None:
            state.first_token(in_flight)
            self.shared_load.changed(in_flight.worker_id)
        else:  # its worker left: nothing counts it any more
            in_flight.prefill_tokens = 0

    def _end(self, in_flight: InFlight) -> None:
        state = self._workers.get(in_flight.worker_id)
        if state is not None:
            state.finish(in_flight)
            self.shared_load.changed(in_flight.worker_id)
        else:
            in_flight.prefill_tokens = 0

    def _own_load(self, worker_ids: Collection[str] | None = None) -> list[RoutedLoad]:
        """This router's contribution to the shared load: of `worker_ids` (zeros included),
        or of every worker it has requests on."""
        if worker_ids is None:
            states = [(worker_id, state) for worker_id, state in self._workers.items() if state.in_flight]
        else:  # a worker that left counts as nothing
            states = [(worker_id, self._workers.get(worker_id)) for worker_id in worker_ids]
        return [RoutedLoad(worker_id=worker_id, in_flight=len(state.in_flight) if state else 0,
                           prefill_tokens=state.outstanding_prefill_tokens if state else 0)
                for worker_id, state in states]

    # ---- bus callbacks ---------------------------------------------------------------

    def _on_disconnect(self) -> None:
        self._disconnected = True

    async def _reconnected(self) -> None:
        self._disconnected = False
        self._reconnected_at = time.monotonic()
        streams = sum(len(state.in_flight) for state in self._workers.values())
        if streams:
            log.warning("reconnected to NATS: resuming or failing %d open streams (frames may be lost)", streams)
        for state in self._workers.values():
            state.abort_all(Reconnected("the router's NATS connection was re-established mid-request"))
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _on_member(self, event: MemberEvent) -> None:
        self._loads.on_member(event)
        worker_id, registration = event.worker_id, event.registration
        if event.change is MemberChange.LEFT:
            self._remove(worker_id)
            return
        if event.change is not MemberChange.UPDATED:
            for listener in self._listeners:
                listener.worker_left(worker_id)  # a restarted worker's cache is gone
                listener.worker_joined(worker_id, registration.block_size,
                                       kv_tokens=kv_pool_tokens(registration), model=registration.model,
                                       lends_host_tier=registration.capabilities.host_tier_lending)
        state = self._workers.get(worker_id)
        if state is None:
            self._workers[worker_id] = WorkerState(registration)
            log.info("worker %s joined (%s, %s, %s)", worker_id, registration.model,
                     registration.role.value, registration.status.value)
        else:
            if event.change is MemberChange.RESTARTED:
                log.warning("worker %s restarted: failing its %d in-flight requests", worker_id,
                            len(state.in_flight))
                state.abort_all(Disconnected(f"worker {worker_id} restarted mid-request"))
                state.load = None
            elif registration.status != state.registration.status:
                log.info("worker %s is now %s", worker_id, registration.status.value)
            if registration.role != state.registration.role:  # a live switch: same process, same cache
                log.info("worker %s now serves as %s", worker_id, registration.role.value)
            state.registration = registration
        self._notify()

    def _remove(self, worker_id: str) -> None:
        state = self._workers.pop(worker_id, None)
        if state is None:
            return
        for listener in self._listeners:
            listener.worker_left(worker_id)
        self.shared_load.peers.worker_left(worker_id)
        log.info("worker %s left the cluster; failing its %d in-flight requests", worker_id, len(state.in_flight))
        state.abort_all(Disconnected(f"worker {worker_id} left the cluster mid-request"))
        self._notify()

    def _on_load(self, snapshot: LoadSnapshot) -> None:
        state = self._workers.get(snapshot.worker_id)
        if state is None:
            return  # not (yet) a member: its next snapshot will count
        state.load = snapshot
        state.reported()
        state.remote_at_report = self.shared_load.remote(snapshot.worker_id)
        if self._members.confirm(snapshot.worker_id):  # it reached us since our reconnect: it is alive
            log.info("worker %s confirmed by its load report since the reconnect", snapshot.worker_id)
            self._notify()
