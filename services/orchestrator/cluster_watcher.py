"""What the orchestrator's periodic watchers share (adapter): the SLO planner (`planner_loop`)
and scale to zero (`model_scaler`).

A `ClusterWatcher` takes in the members (the orchestrator's mirror, `members`), the workers'
load reports (`LoadStream`) and the router's request records (`requests.events`), and calls
its `_tick()` every `interval_s` until stopped; a tick that fails is logged and the next one
tries again. It acts through the control plane (`control`). A subclass says what a load
report and a record mean to it (`_on_snapshot`, `_on_record`), what a tick does, which
other subjects it watches (`_watched`) and which tasks of its own `stop()` ends (`_own_tasks`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from services.orchestrator.config import OrchestratorConfig
from services.orchestrator.control_plane import ControlPlane
from shared.bus import Bus, unsubscribe_quietly
from shared.cluster.load_stream import LoadStream
from shared.cluster.member_events import MemberEvent
from shared.codec import Codec, MalformedCounter
from shared.lifecycle import reraise_if_cancelling
from shared.schemas import LoadSnapshot, RequestRecord, WorkerRegistration
from shared.tasks import cancel_all

log = logging.getLogger(__name__)

MessageHandler = Callable[[Msg], Awaitable[None]]


class ClusterWatcher(ABC):
    name = "watcher"  # in its task's name and its log lines

    def __init__(self, config: OrchestratorConfig, bus: Bus, members: Callable[[], Mapping[str, WorkerRegistration]],
                 control: ControlPlane, malformed: MalformedCounter, *, interval_s: float,
                 clock: Callable[[], float], wall: Callable[[], float] = time.time) -> None:
        self._bus = bus
        self._subjects = config.bus.subjects
        self._members = members
        self._control = control
        self._clock = clock
        self._interval_s = interval_s
        self._records: Codec[RequestRecord] = Codec(RequestRecord, malformed)
        self._loads = LoadStream(bus, self._subjects, self._on_snapshot, malformed, clock=wall)
        self._subscriptions: list[Subscription] = []
        self._task: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()

    async def start(self) -> None:
        await self._loads.start()
        client = self._bus.client
        watched = [(self._subjects.request_events, self._on_record_message), *self._watched()]
        self._subscriptions = [await client.subscribe(subject, cb=handler) for subject, handler in watched]
        await client.flush()
        self._task = asyncio.create_task(self._run(), name=f"orchestrator-{self.name}")

    async def stop(self) -> None:
        self._stopped.set()
        tasks = [task for task in (self._task, *self._own_tasks()) if task is not None]
        await cancel_all(tasks)
        self._task = None
        await unsubscribe_quietly(self._subscriptions, self.name)
        self._subscriptions = []
        await self._loads.stop()

    def on_member(self, event: MemberEvent) -> None:
        self._loads.on_member(event)

    # ---- what a subclass says -------------------------------------------------------------

    def _watched(self) -> list[tuple[str, MessageHandler]]:
        """Subjects watched beside the request records, each with its handler."""
        return []

    def _own_tasks(self) -> tuple[asyncio.Task[None] | None, ...]:
        """Tasks of its own that `stop()` cancels and waits for."""
        return ()

    @abstractmethod
    def _on_snapshot(self, snapshot: LoadSnapshot) -> None: ...

    @abstractmethod
    def _on_record(self, record: RequestRecord) -> None: ...

    @abstractmethod
    async def _tick(self) -> None: ...

    # ---- the loop ---------------------------------------------------------------------------

    async def _on_record_message(self, msg: Msg) -> None:
        record = self._records.decode_or_none(msg.data, msg.subject)
        if record is not None:
            self._on_record(record)

    async def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                await self._tick()
            except Exception as error:  # NATS trouble or a bug in one tick: the next one tries again
                reraise_if_cancelling(error)
                log.exception("%s tick failed", self.name)
            try:
                await asyncio.wait_for(self._stopped.wait(), self._interval_s)  # the period, not a wait for an event
            except TimeoutError:
                pass
            reraise_if_cancelling()
