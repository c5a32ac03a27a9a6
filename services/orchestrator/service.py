"""The orchestrator's membership adapter: the members bucket in, changes and expiries out.

Workers put their `WorkerRegistration` under their id in the members bucket every
heartbeat interval, and delete it on a clean shutdown. This adapter mirrors the bucket
(`MembershipMirror`: each put is a heartbeat, a delete is a deregistration) and feeds
`MembershipTable`.

- Every `sweep_interval_s` it sweeps the table and deletes the keys of workers whose
  heartbeats stopped, so every router mirroring the bucket drops them (a bucket TTL alone
  is not enough: JetStream expires a value without telling existing watchers).
- It publishes the table's `MembershipChange`s on `subjects.membership_changes`, in
  order, as soon as they happen.
- While it is disconnected from NATS it cannot hear heartbeats, so it removes nobody; nor
  after its own loop stalled (a starved host): heartbeats it could not read are no
  evidence of death, so every TTL starts again.
- With `planner.enabled`, it runs the SLO planner (`planner_loop.PlannerLoop`), which acts
  through the same control plane.
- With scalable models and `scale_to_zero.idle_s`, it stops idle models' launched workers
  (`model_scaler.ModelScaler`); routers wake those models through the control plane.
- It serves the control plane (`control_plane.ControlPlane`: cordon, drain, set-role, add
  and remove workers), which reads the same mirror and is woken by its changes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec
from nats.js.errors import KeyDeletedError, KeyWrongLastSequenceError, NotFoundError

from services.orchestrator.config import OrchestratorConfig
from services.orchestrator.control_plane import ControlPlane
from services.orchestrator.launchers import Launcher, build_launcher
from services.orchestrator.membership import MembershipTable
from services.orchestrator.model_scaler import ModelScaler
from services.orchestrator.planner_loop import PlannerLoop
from shared.bus import Bus
from shared.cluster.member_events import MemberChange, MemberEvent
from shared.cluster.membership_mirror import MembershipMirror
from shared.codec import Codec, MalformedCounter, encode
from shared.lifecycle import reraise_if_cancelling
from shared.schemas import WorkerRegistration

log = logging.getLogger(__name__)


class OrchestratorService:
    def __init__(self, config: OrchestratorConfig, bus: Bus, *,
                 clock: Callable[[], float] = time.monotonic, launcher: Launcher | None = None) -> None:
        self._config = config
        self._bus = bus
        self._subjects = config.bus.subjects
        self._clock = clock
        self.table = MembershipTable(config.membership.ttl_s)
        self.malformed = MalformedCounter()
        self._registrations: Codec[WorkerRegistration] = Codec(WorkerRegistration, self.malformed)
        # Registrations of expired workers whose keys are still to be deleted; kept until
        # the delete succeeds, so a NATS outage cannot leave a dead worker in the bucket.
        self._expired: dict[str, WorkerRegistration] = {}
        self._wakeup = asyncio.Event()
        # grace: a restarted NATS's empty bucket is no reason to drop workers that re-register
        self._members = MembershipMirror(bus, self._subjects.members_bucket, self._on_member, self.malformed,
                                         ttl_s=config.membership.bucket_ttl_s, grace_s=config.membership.ttl_s)
        self._task: asyncio.Task[None] | None = None
        self.control = ControlPlane(config, bus, lambda: self._members.members,
                                    launcher if launcher is not None else build_launcher(config), self.malformed)
        self.planner = PlannerLoop(config, bus, lambda: self._members.members, self.control, self.malformed) \
            if config.planner.enabled else None
        scale_to_zero = config.scale_to_zero
        self.model_scaler = ModelScaler(config, bus, lambda: self._members.members, self.control, self.malformed) \
            if scale_to_zero.models and scale_to_zero.idle_s > 0 else None

    async def start(self) -> None:
        await self._members.start()
        self._task = asyncio.create_task(self._run(), name="orchestrator-membership")
        await self.control.start()
        if self.planner is not None:
            await self.planner.start()
        if self.model_scaler is not None:
            await self.model_scaler.start()

    async def stop(self) -> None:
        if self.model_scaler is not None:
            await self.model_scaler.stop()
        if self.planner is not None:
            await self.planner.stop()
        await self.control.stop()
        await self._members.stop()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        # Announce what is already decided (e.g. a deregistration seen just before stop).
        try:
            await self._publish_changes()
        except Exception as error:  # the connection is going away: nothing more to do
            log.warning("orchestrator: could not publish final membership changes: %s", error)

    def _on_member(self, event: MemberEvent) -> None:
        now = self._clock()
        if event.change is MemberChange.LEFT:
            self.table.forget(event.worker_id, now)
        else:
            self._expired.pop(event.worker_id, None)  # it came back before we deleted its key
            self.table.observe(event.registration, now)
        self.control.member_changed()
        if self.planner is not None:
            self.planner.on_member(event)
        if self.model_scaler is not None:
            self.model_scaler.on_member(event)
        self._wakeup.set()  # publish joins and leaves now, not at the next sweep

    async def _run(self) -> None:
        interval = self._config.sweep_interval_s
        next_sweep = self._clock() + interval
        while True:
            waited_from, timeout = self._clock(), max(0.0, next_sweep - self._clock())
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout)
            except TimeoutError:
                pass
            reraise_if_cancelling()  # wait_for can lose a cancellation (Python 3.11)
            self._wakeup.clear()
            overslept_s = self._clock() - waited_from - timeout
            if overslept_s > self.table.ttl_s / 2:  # the loop itself was stalled (a starved host)
                log.warning("orchestrator: its loop stalled for %.1f s; every worker's TTL starts again "
                            "(heartbeats it could not read are no evidence of death)", overslept_s)
                self.table.restart_ttls(self._clock())
            if not self._bus.client.is_connected:
                self.table.restart_ttls(self._clock())
            if self._clock() >= next_sweep:
                for change in self.table.sweep(self._clock()):
                    assert change.registration is not None
                    self._expired[change.worker_id] = change.registration
                next_sweep = self._clock() + interval
            try:
                # Keys first: whoever hears "removed" finds the bucket already agrees.
                await self._delete_expired_keys()
                await self._publish_changes()
            except Exception as error:  # NATS trouble: retried on the next pass, never fatal
                reraise_if_cancelling(error)
                log.warning("orchestrator: membership pass failed (%s); retrying", error)

    async def _publish_changes(self) -> None:
        for change in self.table.take_changes():
            await self._bus.client.publish(self._subjects.membership_changes, encode(change))
            log.info("worker %s %s (%s)", change.worker_id, change.kind, change.reason)

    async def _delete_expired_keys(self) -> None:
        kv = self._members.kv
        assert kv is not None
        # A heartbeat heard during any await here takes the worker out of `_expired` itself.
        for worker_id, registration in list(self._expired.items()):
            try:
                entry = await kv.get(worker_id)
            except KeyDeletedError:
                self._expired.pop(worker_id, None)  # already gone, and watchers saw it go
                continue
            except NotFoundError:
                # Expired by the bucket TTL, which watchers are not told about: a delete
                # marker makes every mirror drop the worker.
                await kv.delete(worker_id)
                self._expired.pop(worker_id, None)
                continue
            if self._heartbeat_since(entry.value, registration):
                # A heartbeat landed after the sweep: the mirror re-joins the worker.
                self._expired.pop(worker_id, None)
                continue
            try:
                # Only delete the revision judged dead, never a fresher heartbeat.
                await kv.delete(worker_id, last=entry.revision)
            except KeyWrongLastSequenceError:
                pass
            self._expired.pop(worker_id, None)

    def _heartbeat_since(self, value: bytes | None, swept: WorkerRegistration) -> bool:
        """Whether the bucket now holds a newer registration than the one judged dead."""
        try:
            current = self._registrations.decode(value or b"")
        except (msgspec.DecodeError, msgspec.ValidationError):
            return False  # garbage is not a heartbeat
        return current != swept
