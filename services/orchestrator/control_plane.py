"""The orchestrator's control plane (adapter): `OrchestratorCommand`s in on
`orchestrator.commands` (request/reply), a `CommandOutcome` back.

Each command is checked first (`command_checks.refusal`, pure, against the members bucket
as mirrored by the orchestrator), then carried out and followed to its end, bounded:

- CordonWorker / UncordonWorker / SetWorkerRole: the admin control message to the worker
  (`ctl.<worker>`, request/reply); `ok` once the members bucket shows the worker's answer
  (its registration of that generation, in that role and status);
- DrainWorker: `Drain` to the worker; `ok` once its registration is gone (it finished its
  requests and its held KV leases, then deregistered), within the drain deadline;
- AddWorker: the launcher starts it; `ok` once it registered; a process that exits or
  never registers is stopped and the answer is `failed` with its log's tail;
- RemoveWorker: a drain, then the launcher stops the process if it started it;
- WakeModel (from a router, on `orchestrator.wake`): a scalable model's missing workers
  started with its directory and name (`model_wake`: one of role both, or its prefill and
  decode workers together); concurrent wakes of one model share that start.
- LoadWorkerAdapter / UnloadWorkerAdapter: `LoadAdapter` / `UnloadAdapter` to the worker;
  `ok` once its registration lists the adapter (or no longer does).

`command_listener.CommandListener` takes commands off the subjects and runs each in its own
task, through `execute`, so a long drain does not hold up a `workers` listing.
The orchestrator's `MembershipMirror` calls `member_changed()` on every bucket change;
waits are on that, with a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Mapping

import msgspec

from services.orchestrator.command_checks import refusal
from services.orchestrator.command_listener import CommandListener
from services.orchestrator.config import OrchestratorConfig
from services.orchestrator.launchers import LaunchedWorker, Launcher, LaunchError, WorkerLaunch
from services.orchestrator.model_wake import ModelWakes
from services.orchestrator.rolling_upgrade import rolling_upgrade
from shared.bus import Bus
from shared.codec import Codec, MalformedCounter, encode
from shared.schemas import (
    ControlReply,
    Cordon,
    Drain,
    LoadAdapter,
    SetRole,
    Uncordon,
    UnloadAdapter,
    WorkerRegistration,
    WorkerStatus,
)
from shared.schemas.control import control_kind
from shared.schemas.orchestrator import (
    AddWorker,
    CommandOutcome,
    CordonWorker,
    DrainWorker,
    ListWorkers,
    LoadWorkerAdapter,
    OrchestratorCommand,
    RemoveWorker,
    SetWorkerRole,
    UncordonWorker,
    UnloadWorkerAdapter,
    UpgradeWorkers,
    WakeModel,
    WorkerSummary,
)
from shared.subjects import check_token

log = logging.getLogger(__name__)

# How much longer than the worker's drain deadline the orchestrator waits for it to leave:
# its last requests' frames, the deregistration and the bucket's watch delivery.
LEAVE_MARGIN_S = 5.0


class ControlPlane:
    def __init__(self, config: OrchestratorConfig, bus: Bus, members: Callable[[], Mapping[str, WorkerRegistration]],
                 launcher: Launcher, malformed: MalformedCounter) -> None:
        self._config = config
        self._bus = bus
        self._subjects = config.bus.subjects
        self._members = members
        self.launcher = launcher
        self._listener = CommandListener(bus, self._subjects, self.execute, malformed)
        self._replies: Codec[ControlReply] = Codec(ControlReply, malformed)
        self._changed = asyncio.Event()
        self._launched: dict[str, LaunchedWorker] = {}
        self._wakes = ModelWakes(self, config)

    async def start(self) -> None:
        try:
            for handle in await self.launcher.recover():
                self._launched[handle.worker_id] = handle
                log.info("worker %s: adopted from an earlier run (%s)", handle.worker_id,
                         handle.container_id or f"pid {handle.pid}")
        except LaunchError as error:  # the engine is away: adds will say so too
            log.warning("could not look for workers of an earlier run: %s", error)
        await self._listener.start()

    async def stop(self) -> None:
        await self._listener.stop()  # no command runs past here
        # Workers this orchestrator started do not outlive it (they drain on SIGTERM).
        await self.launcher.stop_all(self._config.command_timeout_s)

    def member_changed(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # ---- carrying commands out ---------------------------------------------------------

    async def execute(self, command: OrchestratorCommand) -> CommandOutcome:
        members = self._members()
        why = refusal(command, members, self._config.limits, can_launch=self._config.launcher.kind != "none")
        if why is not None:
            return CommandOutcome(outcome="refused", reason=why, worker_id=getattr(command, "worker_id", ""))
        match command:
            case ListWorkers():
                return CommandOutcome(outcome="ok", workers=self.summaries())
            case CordonWorker(worker_id=worker_id):
                return await self._admin(worker_id, Cordon())
            case UncordonWorker(worker_id=worker_id):
                return await self._admin(worker_id, Uncordon())
            case SetWorkerRole(worker_id=worker_id, role=role):
                return await self._admin(worker_id, SetRole(role=role))
            case DrainWorker(worker_id=worker_id, deadline_s=deadline_s):
                return await self._drain(worker_id, deadline_s)
            case RemoveWorker(worker_id=worker_id, deadline_s=deadline_s):
                return await self._remove(worker_id, deadline_s)
            case AddWorker():
                return await self._add(command)
            case UpgradeWorkers():
                return await rolling_upgrade(self, self._config, command)
            case WakeModel(model=model):
                return await self._wakes.wake(model)
            case LoadWorkerAdapter(worker_id=worker_id, adapter=adapter):
                return await self._adapter(worker_id, LoadAdapter(adapter=adapter))
            case UnloadWorkerAdapter(worker_id=worker_id, adapter=adapter):
                return await self._adapter(worker_id, UnloadAdapter(adapter=adapter))
        raise AssertionError(f"unknown command {command!r}")

    def launched(self) -> list[str]:
        """The workers this orchestrator's launcher started and has not stopped."""
        return sorted(self._launched)

    def members(self) -> Mapping[str, WorkerRegistration]:
        return self._members()

    def registration(self, worker_id: str) -> WorkerRegistration | None:
        return self._members().get(worker_id)

    def worker_ids(self) -> list[str]:
        return sorted(self._members())

    def summaries(self) -> list[WorkerSummary]:
        return [WorkerSummary(registration=registration, launched=worker_id in self._launched)
                for worker_id, registration in sorted(self._members().items())]

    async def _ask(self, worker_id: str,
                   message: SetRole | Cordon | Uncordon | Drain | LoadAdapter | UnloadAdapter) -> ControlReply | str:
        """The worker's answer to an admin message, or why there is none."""
        try:
            reply = await self._bus.client.request(self._subjects.control(worker_id, control_kind(message)), encode(message),
                                                   timeout=self._config.command_timeout_s)
        except Exception as error:  # timeout, no responders, connection trouble
            return f"worker {worker_id} did not answer: {type(error).__name__} {error}".strip()
        try:
            return self._replies.decode(reply.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            return f"worker {worker_id} answered something unreadable: {error}"

    async def _admin(self, worker_id: str, message: SetRole | Cordon | Uncordon) -> CommandOutcome:
        reply = await self._ask(worker_id, message)
        if isinstance(reply, str):
            return CommandOutcome(outcome="failed", reason=reply, worker_id=worker_id)
        if reply.outcome == "refused":
            return CommandOutcome(outcome="refused", reason=f"worker {worker_id}: {reply.reason}", worker_id=worker_id)

        def shown() -> bool:
            registration = self._members().get(worker_id)
            return (registration is not None and registration.generation >= reply.generation
                    and registration.role is reply.role and registration.status is reply.status)

        if not await self.wait_until(shown, self._config.command_timeout_s):
            return CommandOutcome(outcome="failed", worker_id=worker_id,
                                  reason=f"worker {worker_id} answered but its registration did not show it "
                                         f"within {self._config.command_timeout_s:g} s")
        return self._done(worker_id, reply.reason)

    async def _adapter(self, worker_id: str, message: LoadAdapter | UnloadAdapter) -> CommandOutcome:
        """`ok` once the worker's registration lists the adapter (load) or no longer does (unload)."""
        reply = await self._ask(worker_id, message)
        if isinstance(reply, str):
            return CommandOutcome(outcome="failed", reason=reply, worker_id=worker_id)
        if reply.outcome == "refused":
            return CommandOutcome(outcome="refused", reason=f"worker {worker_id}: {reply.reason}", worker_id=worker_id)
        wanted = isinstance(message, LoadAdapter)

        def shown() -> bool:
            registration = self._members().get(worker_id)
            return registration is not None and (message.adapter in registration.adapters) == wanted

        if not await self.wait_until(shown, self._config.command_timeout_s):
            return CommandOutcome(outcome="failed", worker_id=worker_id,
                                  reason=f"worker {worker_id} answered but its registration did not show it "
                                         f"within {self._config.command_timeout_s:g} s")
        return self._done(worker_id, reply.reason)

    async def _drain(self, worker_id: str, deadline_s: float) -> CommandOutcome:
        reply = await self._ask(worker_id, Drain(deadline_s=deadline_s))
        if isinstance(reply, str):
            return CommandOutcome(outcome="failed", reason=reply, worker_id=worker_id)
        if reply.outcome == "refused":
            return CommandOutcome(outcome="refused", reason=f"worker {worker_id}: {reply.reason}", worker_id=worker_id)
        if not await self.wait_until(lambda: worker_id not in self._members(), deadline_s + LEAVE_MARGIN_S):
            return CommandOutcome(outcome="failed", worker_id=worker_id,
                                  reason=f"worker {worker_id} is draining but had not left after {deadline_s:g} s")
        return CommandOutcome(outcome="ok", worker_id=worker_id, reason="drained and left")

    async def _remove(self, worker_id: str, deadline_s: float) -> CommandOutcome:
        drained = await self._drain(worker_id, deadline_s)
        handle = self._launched.pop(worker_id, None)
        if handle is None:
            return drained if not drained.ok else CommandOutcome(
                outcome="ok", worker_id=worker_id, reason="drained and left (not started by this orchestrator)")
        status = await self.launcher.stop_worker(handle, self._config.command_timeout_s)
        if not drained.ok:
            return CommandOutcome(outcome="failed", worker_id=worker_id,
                                  reason=f"{drained.reason}; its process was stopped (exit status {status})")
        return CommandOutcome(outcome="ok", worker_id=worker_id, reason=f"drained, left, process exited ({status})")

    async def add(self, command: AddWorker, extra_args: tuple[str, ...] = ()) -> CommandOutcome:
        return await self._add(command, extra_args)

    async def remove(self, worker_id: str, deadline_s: float) -> CommandOutcome:
        return await self._remove(worker_id, deadline_s)

    async def publish(self, subject: str, message: msgspec.Struct) -> None:
        try:
            await self._bus.client.publish(subject, encode(message))
        except Exception as error:  # progress is a courtesy: the outcome still says everything
            log.warning("could not publish on %s: %s", subject, error)

    async def _add(self, command: AddWorker, extra_args: tuple[str, ...] = ()) -> CommandOutcome:
        worker_id = command.worker_id or f"{command.role.value}-{uuid.uuid4().hex[:8]}"
        try:
            check_token(worker_id, "worker id")
        except ValueError as error:
            return CommandOutcome(outcome="refused", reason=str(error), worker_id=worker_id)
        if worker_id in self._launched:
            return CommandOutcome(outcome="refused", reason=f"worker {worker_id} is already starting",
                                  worker_id=worker_id)
        try:
            handle = await self.launcher.start_worker(WorkerLaunch(worker_id=worker_id, role=command.role,
                                                                         extra_args=extra_args))
        except LaunchError as error:
            return CommandOutcome(outcome="failed", reason=str(error), worker_id=worker_id)
        self._launched[worker_id] = handle

        def settled() -> bool:
            registration = self._members().get(worker_id)
            return (registration is not None and registration.status is WorkerStatus.ACTIVE) \
                or not self.launcher.alive(handle)

        timeout_s = self._config.launcher.start_timeout_s
        if await self.wait_until(settled, timeout_s, poll_s=0.1) and self.launcher.alive(handle):
            return self._done(worker_id, f"started (pid {handle.pid}) and registered")
        why = "exited" if not self.launcher.alive(handle) else f"did not register within {timeout_s:g} s"
        tail = await self.launcher.log_tail(handle)
        self._launched.pop(worker_id, None)
        await self.launcher.stop_worker(handle, self._config.command_timeout_s)
        return CommandOutcome(outcome="failed", worker_id=worker_id, reason=f"worker {worker_id} {why}:\n{tail}")

    def done(self, worker_id: str, reason: str) -> CommandOutcome:
        return self._done(worker_id, reason)

    def _done(self, worker_id: str, reason: str) -> CommandOutcome:
        registration = self._members().get(worker_id)
        workers = [] if registration is None else [WorkerSummary(registration=registration,
                                                                 launched=worker_id in self._launched)]
        return CommandOutcome(outcome="ok", worker_id=worker_id, reason=reason, workers=workers)

    async def wait_until(self, condition: Callable[[], bool], timeout_s: float, *, poll_s: float | None = None) -> bool:
        """Whether `condition` held within `timeout_s`; checked on every bucket change (and
        every `poll_s` for conditions that depend on something else, e.g. a process)."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), remaining if poll_s is None else min(remaining, poll_s))
            except TimeoutError:
                pass
        return True
