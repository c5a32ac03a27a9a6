"""Control messages sent to one worker's control subject."""

from __future__ import annotations

from shared.schemas.common import Message
from shared.schemas.transfer import PushDone


class Cancel(Message, tag="cancel", kw_only=True):
    """Stop generating for this request and free its blocks (client went away)."""

    request_id: str


class Drain(Message, tag="drain", kw_only=True):
    """Take no new work, finish in-flight requests within `deadline_s`, then leave."""

    deadline_s: float = 30.0


class KvSnapshotRequest(Message, tag="kv_snapshot", kw_only=True):
    """Ask the worker to re-announce every cached block (a consumer saw a gap).

    The worker answers by publishing `AllBlocksCleared` followed by `BlockStored` events
    for everything it holds, on its normal KV event stream.
    """


ControlMessage = Cancel | Drain | KvSnapshotRequest | PushDone


def control_kind(message: ControlMessage) -> str:
    """The last token of the control subject `message` travels on (`Subjects.control`): its tag."""
    return str(type(message).__struct_config__.tag)
