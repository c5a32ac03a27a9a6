"""The worker service: serves one engine on NATS, by wiring its rooms together.

- request plane (`request_plane`): `generate.<worker>` requests, each in its own task.
- control plane (`control_plane`): `ctl.<worker>.<kind>` messages: cancel, drain, admin,
  adapters, pushes done, KV snapshots.
- admin state (`admin`): role and status; a role switch keeps the engine and its prefix
  cache, and what was taken in the old role (requests, held KV leases) runs to its end.
- membership (`membership`): the registration in the members bucket, put at start, every
  heartbeat, at once after a NATS reconnect; status DRAINING while draining (CORDONED while
  cordoned), `generation` bumped by each admin change; deleted on graceful stop, and no
  heartbeat (its own or a fleet ticker's) puts it back after that.
- KV data plane (optional `connector.dataplane.DataPlane`): leases and transfers, see connector/.
- events: KV event batches and load snapshots, each stream numbered from 1 (`event_streams`).
- periodic work (heartbeat, KV event flush, load snapshot) runs on three timers of the
  service's own, or, with `start(timers=False)`, is driven from outside through
  `heartbeat()`, `flush_kv_events()` and `publish_load()` (a fleet of workers in one
  process runs one shared ticker rather than three tasks per worker).

A drain waits for in-flight requests, then for the KV leases it holds to end (a reader
mid-pull finishes), within its deadline. `stop()` stops the loops, the data plane and the
engine even when NATS is already gone. An engine that died makes the worker `leave_now()`:
deregistered at once, no drain.

The engine is anything that implements `services.worker.engine.Engine`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

from connector.dataplane import DataPlane
from services.worker.adapter_slots import AdapterSlots
from services.worker.admin import Admin
from services.worker.caller_watch import CallerWatch
from services.worker.control_plane import ControlPlane, ControlTargets
from services.worker.engine import Engine
from services.worker.event_streams import WorkerEvents
from services.worker.membership import Membership
from services.worker.request_plane import RequestPlane
from services.worker.request_runner import RequestRunner
from shared.bus import Bus
from shared.codec import MalformedCounter
from shared.config import WorkerConfig
from shared.lifecycle import reraise_if_cancelling
from shared.schemas import Drain, WorkerCapacity, WorkerRegistration
from shared.schemas.membership import EngineCapabilities
from shared.tasks import cancel_all

log = logging.getLogger(__name__)


class WorkerService:
    def __init__(self, config: WorkerConfig, engine: Engine, bus: Bus, kv: DataPlane | None = None, *,
                 capabilities: EngineCapabilities = EngineCapabilities()) -> None:
        self.config = config
        self.engine = engine
        self.bus = bus
        self.kv = kv  # the KV data plane; None: this worker computes everything itself
        self.capabilities = capabilities  # advertised in the registration (the engine spec's)
        self.subjects = config.bus.subjects
        self.malformed = MalformedCounter()
        self.adapters = AdapterSlots(config.max_adapters, config.adapters)
        self.callers = CallerWatch(config.worker_id, config.caller_check_interval_s)
        self.membership = Membership(bus, self.subjects.members_bucket, config.membership.bucket_ttl_s,
                                     config.worker_id, self.registration)
        self.admin = Admin(config.worker_id, config.role, self.membership,
                           lambda: (self.inflight, kv.active_leases if kv is not None else 0))
        runner = RequestRunner(config.worker_id, engine, kv, self.adapters, self.membership.announce_soon)
        self.requests = RequestPlane(config.worker_id, bus, runner, self.callers, self.malformed,
                                     lambda: self.admin.draining)
        self._events = WorkerEvents(config.worker_id, bus, self.subjects, engine, kv)
        self.control = ControlPlane(config.worker_id, bus, self.subjects, self.malformed, ControlTargets(
            requests=self.requests, admin=self.admin, adapters=self.adapters, membership=self.membership,
            engine=engine, events=self._events, kv=kv, drain_then_stop=self._finish_then_stop))
        self._started_at = time.time()
        self._subscriptions: list = []
        self._loops: list[asyncio.Task[None]] = []
        self.stopped = asyncio.Event()

    @property
    def worker_id(self) -> str:
        return self.config.worker_id

    @property
    def inflight(self) -> int:
        return self.requests.inflight

    @property
    def role(self):
        return self.admin.role

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self, *, timers: bool = True) -> None:
        await self.membership.bind()
        client = self.bus.client
        self._subscriptions = [
            await client.subscribe(self.subjects.generate(self.worker_id), cb=self.requests.on_generate),
            await client.subscribe(self.subjects.control_all(self.worker_id), cb=self.control.on_control),
        ]
        await client.flush()
        if self.kv is not None:
            await self.kv.start()
        await self.membership.put()
        self.bus.on_reconnect(self._register_after_reconnect)
        self._loops = [] if not timers else [
            asyncio.create_task(self._every(self.config.membership.heartbeat_interval_s, self.membership.put)),
            asyncio.create_task(self._every(self.config.kv_event_interval_s, self._events.publish_kv_events)),
            asyncio.create_task(self._every(self.config.load_interval_s, self._events.publish_load)),
        ]
        if timers and self.callers.interval_s > 0:
            self._loops.append(asyncio.create_task(self._every(self.callers.interval_s, self.callers.sweep)))
        log.info("worker %s serving %s (%s, %s)", self.worker_id, self.engine.info.model,
                 self.role.value, self.engine.info.engine)

    async def drain(self, deadline_s: float | None = None) -> None:
        """Take no new work; let in-flight requests finish and held KV leases end within the
        deadline; cancel the requests still running then (leases end by their TTL)."""
        if self.admin.draining:
            return
        await self.admin.apply(Drain())
        await self._finish_work(self.config.drain_timeout_s if deadline_s is None else deadline_s)

    async def _finish_work(self, deadline: float) -> None:
        ends_at = time.monotonic() + deadline
        await self.requests.finish(deadline)
        # A prefill worker's held blocks are a decode worker's pull in progress or to come:
        # leaving now would break it. The holder has no completion signal, so poll its count.
        while self.kv is not None and self.kv.active_leases > 0 and time.monotonic() < ends_at:
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        """Graceful stop: drain, deregister, flush events, stop the engine."""
        try:
            await self.drain()
            await self._deregister()
        finally:
            await self._release()

    async def leave_now(self, why: str) -> None:
        """The engine died: out of the membership at once (routers resume this worker's
        requests elsewhere, as for a killed worker, not after the heartbeat TTL), its
        requests ended, everything stopped. No drain: nothing can finish here."""
        log.error("worker %s leaves the cluster now: %s", self.worker_id, why)
        try:
            await self._deregister()
            await self._finish_work(0.0)  # cancels what still runs
        finally:
            await self._release()

    async def _deregister(self) -> None:
        # From here no heartbeat registers the worker again: not its own loops (cancelled),
        # nor a fleet's ticker calling `heartbeat()` while the engine stops.
        self.membership.stop_putting()
        await cancel_all(self._loops)
        try:
            if self.bus.client.is_connected:  # else each call would wait out its timeout
                for sub in self._subscriptions:
                    await sub.unsubscribe()
            await self.membership.leave()
        except Exception as error:  # NATS already gone: the orchestrator's TTL removes us
            log.warning("could not deregister %s: %s", self.worker_id, error)

    async def _release(self) -> None:
        try:
            if self.kv is not None:
                await self.kv.stop()
        finally:
            await self.engine.stop()  # whatever failed above, the engine (vLLM: processes) stops
        with contextlib.suppress(Exception):
            await self._events.publish_kv_events()
        self.stopped.set()

    async def _every(self, interval_s: float, action) -> None:
        failing, name = 0, getattr(action, "__name__", action)  # a streak's first failure and its end are told
        while True:
            await asyncio.sleep(interval_s)
            try:
                await action()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # NATS reconnecting: try again next tick
                reraise_if_cancelling(error)  # or stop() would wait for this loop for ever
                failing += 1
                (log.warning if failing == 1 else log.debug)("%s failed: %r", name, error, exc_info=failing == 1)
            else:
                if failing:
                    log.warning("%s works again after %d failed ticks", name, failing)
                failing = 0
            reraise_if_cancelling()

    async def _finish_then_stop(self, deadline_s: float) -> None:
        await self._finish_work(deadline_s)
        await self.stop()

    # ---- membership and events -------------------------------------------------------

    def registration(self) -> WorkerRegistration:
        info, admin = self.engine.info, self.admin.state
        return WorkerRegistration(
            worker_id=self.worker_id,
            role=admin.role,
            model=info.model,
            engine=info.engine,
            block_size=info.block_size,
            compat_hash=info.compat_hash,
            model_version=info.layout.model_version,
            model_dir=os.path.abspath(self.config.model_dir) if self.config.model_dir else "",
            kv_transfer=self.kv is not None,
            capabilities=self.capabilities,
            capacity=WorkerCapacity(kv_blocks=info.kv_blocks, max_num_seqs=info.max_num_seqs,
                                    max_model_len=info.max_model_len),
            status=admin.status,
            started_at=self._started_at,
            heartbeat_at=time.time(),
            pid=os.getpid(),
            generation=admin.generation,
            restarts=self.config.restarts, last_exit=self.config.last_exit,
            kv_layout=info.layout,
            adapters=self.adapters.held,
            adapter_slots=self.adapters.slots,
        )

    async def heartbeat(self) -> None:
        await self.membership.put()

    async def flush_kv_events(self) -> None:
        await self._events.publish_kv_events()

    async def publish_load(self) -> None:
        await self._events.publish_load()

    async def _register_after_reconnect(self) -> None:
        if not self.stopped.is_set() and self.membership.bound:
            await self.membership.put()
