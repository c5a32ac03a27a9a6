"""Control messages sent to one worker's control subject."""

from __future__ import annotations

from typing import Literal

from shared.schemas.common import Message
from shared.schemas.membership import WorkerRole, WorkerStatus
from shared.schemas.transfer import PushDone


class Cancel(Message, tag="cancel", kw_only=True):
    """Stop generating for this request and free its blocks (client went away)."""

    request_id: str


class Drain(Message, tag="drain", kw_only=True):
    """Take no new work, finish in-flight requests and let held KV leases end (their readers
    finish their pulls) within `deadline_s`, then leave. Answered with a `ControlReply` when
    sent as a request."""

    deadline_s: float = 30.0


class KvSnapshotRequest(Message, tag="kv_snapshot", kw_only=True):
    """Ask the worker to re-announce every cached block (a consumer saw a gap).

    The worker answers by publishing `AllBlocksCleared` followed by `BlockStored` events
    for everything it holds, on its normal KV event stream.
    """


class SetRole(Message, tag="set_role", kw_only=True):
    """Serve in `role` from now on, engine and prefix cache kept: the worker re-registers at
    once with the new role and a new generation; work it took in the old role finishes and
    the KV leases it holds are honoured. Answered with a `ControlReply`."""

    role: WorkerRole


class Cordon(Message, tag="cordon", kw_only=True):
    """Take no new work (routers skip a cordoned worker), keep serving what is in flight,
    stay registered. Answered with a `ControlReply`."""


class Uncordon(Message, tag="uncordon", kw_only=True):
    """Take new work again after a `Cordon`. Answered with a `ControlReply`."""


class LoadAdapter(Message, tag="load_adapter", kw_only=True):
    """Hold the model's LoRA adapter `adapter` from now on (evicting the least recently used
    one when every adapter slot is taken); the worker re-registers at once with it. Refused by
    a worker without adapter slots. Answered with a `ControlReply`."""

    adapter: str


class UnloadAdapter(Message, tag="unload_adapter", kw_only=True):
    """Stop holding `adapter` (a request naming it loads it again); the worker re-registers at
    once without it. Answered with a `ControlReply`."""

    adapter: str


ControlOutcome = Literal["applied", "unchanged", "refused"]


class ControlReply(Message, tag="control_reply", kw_only=True):
    """A worker's answer to an admin control message: `applied` (the registration carrying
    it is in the members bucket), `unchanged` (it already was so) or `refused` (with why)."""

    outcome: ControlOutcome
    reason: str = ""
    role: WorkerRole
    status: WorkerStatus
    generation: int


ControlMessage = (Cancel | Drain | KvSnapshotRequest | PushDone | SetRole | Cordon | Uncordon | LoadAdapter
                  | UnloadAdapter)


def control_kind(message: ControlMessage) -> str:
    """The last token of the control subject `message` travels on (`Subjects.control`): its tag."""
    return str(type(message).__struct_config__.tag)
