"""The worker service: serves one engine on NATS.

- request plane: `generate.<worker>` requests, each run by a `RequestRunner` in its own
  task; frames streamed to the caller's inbox (`Accepted`, `Tokens`..., then exactly one
  `Finished` or `Failed`).
- control plane: `ctl.<worker>.<kind>` takes `Cancel`, `Drain`, `KvSnapshotRequest`, `PushDone`,
  and the admin messages `SetRole`, `Cordon`, `Uncordon` (answered with a `ControlReply`
  once the registration carrying the change is in the bucket; `admin_state` decides), each
  on the subject of its kind (its tag): NATS permissions say who may send which; another
  kind is dropped.
- role switch: the role only tells routers what to send; the engine serves any part of a
  request, so a switch keeps the engine and its prefix cache, and what was taken in the
  old role (requests, held KV leases) simply runs to its end.
- KV data plane (optional `connector.dataplane.DataPlane`): leases and transfers, see connector/.
- events: KV event batches and load snapshots, each stream numbered from 1 (`event_streams`).
- periodic work (heartbeat, KV event flush, load snapshot) runs on three timers of the
  service's own, or, with `start(timers=False)`, is driven from outside through
  `heartbeat()`, `flush_kv_events()` and `publish_load()` (a fleet of workers in one
  process runs one shared ticker rather than three tasks per worker).
- membership: the registration is put in the members bucket at start, every heartbeat
  and at once after a NATS reconnect (a restarted server may have lost the bucket);
  status DRAINING while draining (CORDONED while cordoned), `generation` bumped by each
  admin change; the key is deleted on graceful stop, and no heartbeat (its own or a
  fleet ticker's) puts it back after that. A drain waits for in-flight requests,
  then for the KV leases it holds to end (a reader mid-pull finishes), within its deadline. `stop()` stops the
  loops, the data plane and the engine even when NATS is already gone. An engine that
  died makes the worker `leave_now()`: deregistered at once, no drain.

The engine is anything that implements `services.worker.engine.Engine`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

from nats.aio.msg import Msg

from connector.dataplane import DataPlane
from services.worker import admin_state
from services.worker.adapter_slots import AdapterSlots, apply_adapter_message
from services.worker.admin_state import AdminState
from services.worker.caller_watch import CallerWatch
from services.worker.engine import Engine
from services.worker.event_streams import WorkerEvents
from services.worker.request_runner import RequestRunner
from shared.bus import Bus
from shared.codec import Codec, MalformedCounter, encode
from shared.config import WorkerConfig
from shared.errors import Disconnected, ErrorCode
from shared.lifecycle import reraise_if_cancelling
from shared.request_plane import FrameSender
from shared.schemas import (
    AllBlocksCleared,
    Cancel,
    ControlMessage,
    ControlReply,
    Cordon,
    Drain,
    GenerateRequest,
    KvSnapshotRequest,
    LoadAdapter,
    PushDone,
    SetRole,
    Uncordon,
    UnloadAdapter,
    WorkerCapacity,
    WorkerRegistration,
    WorkerStatus,
)
from shared.schemas.control import ControlOutcome, control_kind
from shared.schemas.membership import EngineCapabilities

log = logging.getLogger(__name__)



class WorkerService:
    def __init__(self, config: WorkerConfig, engine: Engine, bus: Bus, kv: DataPlane | None = None, *,
                 capabilities: EngineCapabilities = EngineCapabilities()) -> None:
        self.config = config
        self.engine = engine
        self.bus = bus
        self.kv = kv  # the KV data plane; None: this worker computes everything itself
        self.capabilities = capabilities  # advertised in the registration (the engine spec's)
        self.adapters = AdapterSlots(config.max_adapters, config.adapters)
        self._runner = RequestRunner(config.worker_id, engine, kv, self.adapters, self._announce_soon)
        self._announcements: set[asyncio.Task[None]] = set()
        self.subjects = config.bus.subjects
        self.malformed = MalformedCounter()
        self._requests: Codec[GenerateRequest] = Codec(GenerateRequest, self.malformed)
        self._control: Codec[ControlMessage] = Codec(ControlMessage, self.malformed)
        self._inflight: dict[str, asyncio.Task[None]] = {}
        self.callers = CallerWatch(config.worker_id, config.caller_check_interval_s)
        self._admin = AdminState(role=config.role)
        self._started_at = time.time()
        self._events = WorkerEvents(config.worker_id, bus, self.subjects, engine, kv)
        self._subscriptions: list = []
        self._loops: list[asyncio.Task[None]] = []
        self._members = None
        self._membership = asyncio.Lock()  # one registration put or delete at a time, in order
        self._left = False  # deregistered (or deregistering): no heartbeat registers it again
        self._drain_task: asyncio.Task[None] | None = None  # a Drain message's drain-then-stop
        self.stopped = asyncio.Event()

    @property
    def worker_id(self) -> str:
        return self.config.worker_id

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    @property
    def role(self):
        return self._admin.role

    @property
    def _status(self) -> WorkerStatus:
        return self._admin.status

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self, *, timers: bool = True) -> None:
        self._members = await self._bind_members()
        client = self.bus.client
        self._subscriptions = [
            await client.subscribe(self.subjects.generate(self.worker_id), cb=self._on_generate),
            await client.subscribe(self.subjects.control_all(self.worker_id), cb=self._on_control),
        ]
        await client.flush()
        if self.kv is not None:
            await self.kv.start()
        await self._register()
        self.bus.on_reconnect(self._register_after_reconnect)
        self._loops = [] if not timers else [
            asyncio.create_task(self._every(self.config.membership.heartbeat_interval_s, self._register)),
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
        if self._status is WorkerStatus.DRAINING:
            return
        await self._apply_admin(Drain())
        await self._finish_work(self.config.drain_timeout_s if deadline_s is None else deadline_s)

    async def _finish_work(self, deadline: float) -> None:
        ends_at = time.monotonic() + deadline
        pending = list(self._inflight.values())
        if pending:
            _, still_running = await asyncio.wait(pending, timeout=deadline)
            for task in still_running:
                task.cancel()
            await asyncio.gather(*still_running, return_exceptions=True)
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
        self._left = True
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        try:
            if not self.bus.client.is_connected:  # each call would wait out its timeout
                raise Disconnected("not connected to NATS")
            for sub in self._subscriptions:
                await sub.unsubscribe()
            async with self._membership:  # after a put already under way, never before it
                if self._members is not None:
                    await self._members.delete(self.worker_id)
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

    # ---- membership and events -------------------------------------------------------

    def registration(self) -> WorkerRegistration:
        info = self.engine.info
        return WorkerRegistration(
            worker_id=self.worker_id,
            role=self._admin.role,
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
            status=self._status,
            started_at=self._started_at,
            heartbeat_at=time.time(),
            pid=os.getpid(),
            generation=self._admin.generation,
            restarts=self.config.restarts, last_exit=self.config.last_exit,
            kv_layout=info.layout,
            adapters=self.adapters.held,
            adapter_slots=self.adapters.slots,
        )

    async def heartbeat(self) -> None:
        await self._register()

    async def flush_kv_events(self) -> None:
        await self._events.publish_kv_events()

    async def publish_load(self) -> None:
        await self._events.publish_load()

    async def _bind_members(self):
        return await self.bus.key_value(self.subjects.members_bucket, ttl_s=self.config.membership.bucket_ttl_s)

    async def _register(self) -> None:
        if not self.bus.client.is_connected:  # a KV put would wait out its timeout: the heartbeat after reconnecting carries it
            raise Disconnected("not connected to NATS")
        async with self._membership:
            if self._left:
                return
            value = encode(self.registration())
            try:
                await self._members.put(self.worker_id, value)
            except Exception:  # e.g. a restarted NATS lost the bucket: bind (re-create) and retry once
                self._members = await self._bind_members()
                await self._members.put(self.worker_id, value)

    def _announce_soon(self) -> None:
        """Register now rather than at the next heartbeat (what it holds changed)."""
        task = asyncio.create_task(self._register_quietly(), name="announce")
        self._announcements.add(task)
        task.add_done_callback(self._announcements.discard)

    async def _register_quietly(self) -> None:
        try:
            await self._register()
        except Exception as error:  # NATS gone: the next heartbeat carries it
            reraise_if_cancelling(error)
            log.debug("could not register %s: %s", self.worker_id, error)

    async def _register_after_reconnect(self) -> None:
        if not self.stopped.is_set() and self._members is not None:
            await self._register()

    # ---- request plane ---------------------------------------------------------------

    async def _on_generate(self, msg: Msg) -> None:
        request = self._requests.decode_or_none(msg.data, msg.subject)
        if not msg.reply:
            return  # nobody to answer: a request without an inbox is dropped
        sender = FrameSender(self.bus, msg.reply)
        if request is None:
            await sender.failed(ErrorCode.INVALID_ARGUMENT.value, "malformed generate request")
            return
        if self._status is WorkerStatus.DRAINING:
            await sender.failed(ErrorCode.UNAVAILABLE.value, f"worker {self.worker_id} is draining")
            return
        if request.request_id in self._inflight:
            await sender.failed(ErrorCode.INVALID_ARGUMENT.value, f"duplicate request id {request.request_id}")
            return
        task = asyncio.create_task(self._runner.run(request, sender, dict(msg.headers or {})),
                                   name=f"request:{request.request_id}")
        self._inflight[request.request_id] = task
        task.add_done_callback(lambda _: self._inflight.pop(request.request_id, None))
        self.callers.track(request.request_id, sender, task)

    # ---- control plane ---------------------------------------------------------------

    async def _on_control(self, msg: Msg) -> None:
        message = self._control.decode_or_none(msg.data, msg.subject)
        if message is not None and msg.subject != self.subjects.control(self.worker_id, control_kind(message)):
            # who may send a kind is NATS's to say, by subject: a message of another kind is forged
            self.malformed.record(msg.subject, ValueError(f"a {control_kind(message)} message on this subject"))
            return
        match message:
            case Cancel(request_id=request_id):
                task = self._inflight.get(request_id)
                if task is not None:
                    task.cancel()
            case Drain(deadline_s=deadline_s):
                outcome, reason = await self._apply_admin(message)
                if outcome == "applied":
                    self._drain_task = asyncio.create_task(self._finish_then_stop(deadline_s), name="drain")
                await self._reply(msg, outcome, reason)
            case SetRole() | Cordon() | Uncordon():
                outcome, reason = await self._apply_admin(message)
                await self._reply(msg, outcome, reason)
            case LoadAdapter() | UnloadAdapter():
                outcome, reason = await self._apply_adapter(message)
                await self._reply(msg, outcome, reason)
            case PushDone():
                if self.kv is not None:
                    self.kv.deliver_push(message)
            case KvSnapshotRequest():
                await self._events.publish_kv_events()  # flush what is buffered, then re-announce all
                await self._events.publish_kv_events([AllBlocksCleared(), *self.engine.kv_snapshot()])
            case None:
                pass

    async def _apply_adapter(self, message: LoadAdapter | UnloadAdapter) -> tuple[ControlOutcome, str]:
        """Load or unload an adapter, and announce it at once (not at the next heartbeat)."""
        outcome, reason = await apply_adapter_message(message, self.adapters, self.engine)
        if outcome == "applied":
            log.info("worker %s: %s", self.worker_id, reason)
            await self._register_quietly()
        return outcome, reason

    async def _apply_admin(self, message: admin_state.AdminMessage) -> tuple[ControlOutcome, str]:
        """Change role or status, and announce it at once (not at the next heartbeat)."""
        transition = admin_state.apply(self._admin, message)
        if transition.outcome != "applied":
            return transition.outcome, transition.reason
        previous, self._admin = self._admin, transition.state
        reason = ""
        if previous.role is not self._admin.role:
            leases = self.kv.active_leases if self.kv is not None else 0
            reason = (f"{previous.role.value} -> {self._admin.role.value}, engine and cache kept; "
                      f"{self.inflight} request(s) in flight and {leases} KV lease(s) held run to their end")
            log.info("worker %s switches role: %s", self.worker_id, reason)
        try:
            await self._register()
        except Exception as error:  # NATS gone: the next heartbeat carries it
            reraise_if_cancelling(error)
            log.warning("%s could not announce %s: %s", self.worker_id, type(message).__name__, error)
            return "applied", f"not announced yet: {error}"
        return "applied", reason

    async def _reply(self, msg: Msg, outcome: ControlOutcome, reason: str = "") -> None:
        if not msg.reply:
            return
        reply = ControlReply(outcome=outcome, reason=reason, role=self._admin.role,
                             status=self._admin.status, generation=self._admin.generation)
        try:
            await self.bus.client.publish(msg.reply, encode(reply))
        except Exception as error:  # the asker times out and says so
            log.warning("%s could not answer a control message: %s", self.worker_id, error)

    async def _finish_then_stop(self, deadline_s: float) -> None:
        await self._finish_work(deadline_s)
        await self.stop()
