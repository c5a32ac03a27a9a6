"""A worker's control plane: `ctl.<worker>.<kind>` takes `Cancel`, `Drain`, `KvSnapshotRequest`,
`PushDone`, the adapter messages `LoadAdapter`, `UnloadAdapter`, and the admin messages
`SetRole`, `Cordon`, `Uncordon`, each on the subject of its kind (its tag): NATS permissions
say who may send which, and a message of another kind is counted as malformed and dropped.
Admin and adapter messages are answered with a `ControlReply` once the registration
carrying the change is in the bucket; an applied `Drain` ends in `drain_then_stop`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from nats.aio.msg import Msg

from connector.dataplane import DataPlane
from services.worker.adapter_slots import AdapterSlots, apply_adapter_message
from services.worker.admin import Admin
from services.worker.engine import Engine
from services.worker.event_streams import WorkerEvents
from services.worker.membership import Membership
from services.worker.request_plane import RequestPlane
from shared.bus import Bus
from shared.codec import Codec, MalformedCounter, encode
from shared.schemas import (
    AllBlocksCleared,
    Cancel,
    ControlMessage,
    ControlReply,
    Cordon,
    Drain,
    KvSnapshotRequest,
    LoadAdapter,
    PushDone,
    SetRole,
    Uncordon,
    UnloadAdapter,
)
from shared.schemas.control import ControlOutcome, control_kind
from shared.subjects import Subjects

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ControlTargets:
    """What control messages act on, each a room of the worker's own."""

    requests: RequestPlane
    admin: Admin
    adapters: AdapterSlots
    membership: Membership
    engine: Engine
    events: WorkerEvents
    kv: DataPlane | None
    drain_then_stop: Callable[[float], Awaitable[None]]


@dataclass(eq=False)
class ControlPlane:
    worker_id: str
    bus: Bus
    subjects: Subjects
    malformed: MalformedCounter
    targets: ControlTargets
    _control: Codec[ControlMessage] = field(init=False)
    _drain_task: asyncio.Task[None] | None = field(init=False, default=None)  # a Drain message's drain-then-stop

    def __post_init__(self) -> None:
        self._control = Codec(ControlMessage, self.malformed)

    async def on_control(self, msg: Msg) -> None:
        message = self._control.decode_or_none(msg.data, msg.subject)
        if message is not None and msg.subject != self.subjects.control(self.worker_id, control_kind(message)):
            # who may send a kind is NATS's to say, by subject: a message of another kind is forged
            self.malformed.record(msg.subject, ValueError(f"a {control_kind(message)} message on this subject"))
            return
        targets = self.targets
        match message:
            case Cancel(request_id=request_id):
                targets.requests.cancel(request_id)
            case Drain(deadline_s=deadline_s):
                outcome, reason = await targets.admin.apply(message)
                if outcome == "applied":
                    self._drain_task = asyncio.create_task(targets.drain_then_stop(deadline_s), name="drain")
                await self._reply(msg, outcome, reason)
            case SetRole() | Cordon() | Uncordon():
                await self._reply(msg, *await targets.admin.apply(message))
            case LoadAdapter() | UnloadAdapter():
                await self._reply(msg, *await self._apply_adapter(message))
            case PushDone():
                if targets.kv is not None:
                    targets.kv.deliver_push(message)
            case KvSnapshotRequest():
                await targets.events.publish_kv_events()  # flush what is buffered, then re-announce all
                await targets.events.publish_kv_events([AllBlocksCleared(), *targets.engine.kv_snapshot()])
            case None:
                pass

    async def _apply_adapter(self, message: LoadAdapter | UnloadAdapter) -> tuple[ControlOutcome, str]:
        """Load or unload an adapter, and announce it at once (not at the next heartbeat)."""
        outcome, reason = await apply_adapter_message(message, self.targets.adapters, self.targets.engine)
        if outcome == "applied":
            log.info("worker %s: %s", self.worker_id, reason)
            await self.targets.membership.put_quietly()
        return outcome, reason

    async def _reply(self, msg: Msg, outcome: ControlOutcome, reason: str = "") -> None:
        if not msg.reply:
            return
        state = self.targets.admin.state
        reply = ControlReply(outcome=outcome, reason=reason, role=state.role, status=state.status,
                             generation=state.generation)
        try:
            await self.bus.client.publish(msg.reply, encode(reply))
        except Exception as error:  # the asker times out and says so
            log.warning("%s could not answer a control message: %s", self.worker_id, error)
