"""Every message on the bus, as msgspec Structs: one tagged union per stream.

Streams and their unions:
- request plane (router -> worker `generate`):  `GenerateRequest`
- response chunks (worker -> caller's inbox):    `ResponseFrame`
- control (-> worker `ctl.<worker>.<kind>`):     `ControlMessage`
- KV events (worker -> `kv.events.<w>`):         `KvEventBatch` holding `KvEvent`s
- load (worker -> `load.<w>`):                   `LoadSnapshot`
- membership bucket values:                      `WorkerRegistration`
- membership changes (orchestrator):            `MembershipChange`
- orchestrator commands (request/reply):        `OrchestratorCommand` answered by `CommandOutcome`;
  a long command's steps on `orchestrator.progress`: `CommandProgress`
- request events (router -> collector):         `RequestRecord`
- routers' shared load (router -> `router.load.<r>`): `RouterLoad`
- KV leases (reader -> holder `kv.lease.<w>`):    `LeaseMessage` answered by `LeaseReply`
- push completion (writer -> reader `ctl`):     `PushDone` (part of `ControlMessage`)
- lease releases (router -> holder `kv.release.<w>`): `LeaseRelease` answered by `LeaseAck`
- transfer records (reader -> `kv.transfers.<w>`): `TransferRecord`

Schema evolution follows msgspec's rules: new fields get defaults, types never change.
`SCHEMA_VERSION` travels in every top-level message as `v`.
"""

from shared.schemas.common import SCHEMA_VERSION
from shared.schemas.control import (
    Cancel,
    ControlMessage,
    ControlReply,
    Cordon,
    Drain,
    KvSnapshotRequest,
    LoadAdapter,
    SetRole,
    Uncordon,
    UnloadAdapter,
)
from shared.schemas.generate import (
    Accepted,
    Failed,
    Finished,
    GenerateRequest,
    KvTarget,
    ResponseFrame,
    SamplingParams,
    TokenLogprobs,
    Tokens,
)
from shared.schemas.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlocksMoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
)
from shared.schemas.load import LoadSnapshot
from shared.schemas.membership import (
    EngineCapabilities,
    MembershipChange,
    WorkerCapacity,
    WorkerRegistration,
    WorkerRole,
    WorkerStatus,
)
from shared.schemas.requests import RequestRecord
from shared.schemas.router_load import RoutedLoad, RoutedPrompt, RouterLoad
from shared.schemas.transfer import (
    AgentInfo,
    AgentInfoRequest,
    KvHandle,
    KvTransferParams,
    LeaseAck,
    LeaseExtend,
    LeaseGrant,
    LeaseMessage,
    LeaseRefused,
    LeaseRelease,
    LeaseReply,
    LeaseRequest,
    PushDone,
    PushTarget,
    TransferRecord,
)

__all__ = [
    "AgentInfo",
    "AgentInfoRequest",
    "KvHandle",
    "KvTarget",
    "KvTransferParams",
    "LeaseAck",
    "LeaseExtend",
    "LeaseGrant",
    "LeaseMessage",
    "LeaseRefused",
    "LeaseRelease",
    "LeaseReply",
    "LeaseRequest",
    "PushDone",
    "PushTarget",
    "TransferRecord",
    "SCHEMA_VERSION",
    "Accepted",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlocksMoved",
    "BlockStored",
    "Cancel",
    "ControlMessage",
    "ControlReply",
    "Cordon",
    "LoadAdapter",
    "UnloadAdapter",
    "SetRole",
    "Uncordon",
    "Drain",
    "Failed",
    "Finished",
    "GenerateRequest",
    "KvEvent",
    "KvEventBatch",
    "KvSnapshotRequest",
    "LoadSnapshot",
    "MembershipChange",
    "RequestRecord",
    "RoutedLoad",
    "RoutedPrompt",
    "RouterLoad",
    "ResponseFrame",
    "SamplingParams",
    "TokenLogprobs",
    "Tokens",
    "EngineCapabilities",
    "WorkerCapacity",
    "WorkerRegistration",
    "WorkerRole",
    "WorkerStatus",
]
