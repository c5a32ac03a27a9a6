"""What crosses vLLM's process boundaries for Tandem's KV connector (pure data, no vLLM import).

Three processes take part (see `tandem_connector` for the whole picture): the Tandem worker
(AsyncLLM), vLLM's EngineCore (the connector's scheduler side) and the model worker (the
connector's worker side, with the KV cache and the NIXL agent).

- in, with a generate request: a `TransferOrder` in vLLM's `kv_transfer_params` (hold the
  prompt's blocks when it finishes; pull blocks from a holder before computing; push the
  prompt's blocks, layer by layer, into a decode worker's as they are computed);
- in, as a control request (a pre-aborted vLLM request: it reaches the scheduler side's
  `on_new_request` without being scheduled): `PinOrder` / `UnpinOrder`, and for a push's
  reader `AllocOrder` (fresh blocks for the writer) / `CommitOrder` (cache what verified);
- out, with the final output: `Held` (the pinned prompt blocks) in `kv_transfer_params`;
- out, on the report socket (ZMQ PUSH -> the worker's PULL): `Pinned`, `Loaded`, `Pushed`
  (the last two with the sending rank's transfer counters: the worker never asks for them);
- scheduler side -> worker side, in the step's connector metadata: `LoadSpec`, `PushSpec`,
  and with a host-memory tier `HostCopy` (blocks loaded from it, blocks saved to it).

Schema evolution: new fields get defaults; types never change.
"""

from __future__ import annotations

from typing import Any

import msgspec

from connector.kv_geometry import RankGeometry
from shared.schemas.load import RankTransfers

ORDER_KEY = "tandem"  # kv_transfer_params key of a generate request's order
CONTROL_KEY = "tandem_control"  # kv_transfer_params key of a control request
HELD_KEY = "tandem_held"  # kv_transfer_params key of the final output's held blocks


class PullOrder(msgspec.Struct, frozen=True, kw_only=True):
    """Read these blocks of a holder's pool instead of computing them (token order)."""

    lease_id: str
    agent_name: str
    agent_metadata: bytes  # the holder's `connector.kv_peer.KvPeer`: its shape and rank agents
    block_ids: list[int]
    checksums: list[int]  # per block and KV head (`connector.kv_checksums`), taken when the lease was granted
    tail_tokens: int = 0  # non-zero: the last block is a prompt's partial block, with this many tokens
    block_size: int = 0  # the holder's (0: this engine's)


class PushOrder(msgspec.Struct, frozen=True, kw_only=True):
    """Write the prompt's blocks into a reader's blocks as each layer is computed."""

    agent_name: str
    agent_metadata: bytes  # the reader's `connector.kv_peer.KvPeer`
    # The reader's, one per prompt block (token order), the partial last one too where the
    # reader takes it (written whole at the prompt's last step); maybe fewer
    block_ids: list[int]


class TailOrder(msgspec.Struct, frozen=True, kw_only=True):
    """A push's reader: the prompt's partial last block arrived in block `block_id` (pinned
    under the order's `release_key`) with `tokens` prompt tokens: copied into the request's
    own block instead of computed (vLLM's prefix cache holds only full blocks)."""

    block_id: int
    tokens: int


class TransferOrder(msgspec.Struct, frozen=True, kw_only=True):
    transfer_id: str  # Tandem's request id: vLLM renames requests internally
    hold_key: str = ""  # non-empty: pin the prompt's blocks under this key when it finishes
    pull: PullOrder | None = None
    push: PushOrder | None = None
    release_key: str = ""  # non-empty: the worker unpins this key once the request was admitted
    tail: TailOrder | None = None


class PinOrder(msgspec.Struct, frozen=True, kw_only=True, tag="pin"):
    """Pin the longest cached prefix under `key`: of the blocks `block_hashes` names (vLLM's
    own hashes in its KV events' form, which take in a block's images, adapter and salt), or
    of the control request's own prompt where that finds more."""

    key: str
    block_hashes: list[int] = []


class UnpinOrder(msgspec.Struct, frozen=True, kw_only=True, tag="unpin"):
    keys: list[str]  # unknown keys are ignored: unpinning is idempotent


class AllocOrder(msgspec.Struct, frozen=True, kw_only=True, tag="alloc"):
    """A push's reader: take `count` free blocks and pin them under `key` (answered by
    `Pinned`, no blocks if the pool cannot spare them)."""

    key: str
    count: int


class ImagePlace(msgspec.Struct, frozen=True, array_like=True):
    """An image of a prompt as vLLM's block hashes take it in: its identifier (the request's
    `multi_modal_uuids`) and its placeholder tokens' place."""

    identifier: str
    offset: int
    length: int


class CommitOrder(msgspec.Struct, frozen=True, kw_only=True, tag="commit"):
    """A push's reader: the first `count` blocks pinned under `key` hold the control
    request's prompt blocks (written and verified): cache them under its block hashes, which
    take in `images` where the prompt has any (as the request's own will, so that it finds
    them). They stay pinned; blocks after `count` are unpinned (answered by `Pinned`: the
    cached), but for the one right after them where `keep_next` (a partial last block that
    the request copies: `TailOrder`)."""

    key: str
    count: int
    images: list[ImagePlace] = []
    keep_next: bool = False


ControlOrder = PinOrder | UnpinOrder | AllocOrder | CommitOrder


class Held(msgspec.Struct, frozen=True, kw_only=True):
    key: str
    block_ids: list[int]  # the prompt's blocks, in token order
    tail_tokens: int = 0  # non-zero: the last block is partial, with this many prompt tokens


class Pinned(msgspec.Struct, frozen=True, kw_only=True, tag="pinned"):
    key: str
    block_ids: list[int]  # the longest cached prefix, possibly empty


class Loaded(msgspec.Struct, frozen=True, kw_only=True, tag="loaded"):
    """The outcome of a pull in one rank, sent by its worker side in the step that loaded it
    (`merge_loaded` makes the engine's of every rank's). Blocks are the holder's: the pull's
    units."""

    transfer_id: str
    lease_id: str
    cached_blocks: int  # leading holder blocks of the order found in the local prefix cache (not read)
    ok: list[bool]  # per holder block read (those after `cached_blocks`): arrived and verified
    nbytes: int = 0
    duration_s: float = 0.0
    reason: str = ""
    retried: int = 0  # blocks read again after a failed read or verification
    recovered: int = 0  # of those, blocks that then arrived and verified (counted in `ok`)
    rank: int = 0
    kept: int = -1  # leading holder blocks vLLM keeps (-1: up to the first one not ok)
    transfers: RankTransfers | None = None  # the rank's agent's counters as it sent this (None: older sender)

    @property
    def used_blocks(self) -> int:
        """Blocks vLLM keeps: its computed prefix cannot have holes, so it recomputes
        everything from the first failed block of its own on (which may hold a sound holder
        block when the block sizes differ)."""
        if self.kept >= 0:
            return self.kept
        return self.ok.index(False) if False in self.ok else len(self.ok)


def merge_loaded(reports: list[Loaded]) -> Loaded:
    """The pull's outcome over every rank: a block is ok where every rank's read of its
    share was; vLLM keeps what every rank keeps. Counters stay with each rank's own report."""
    first = reports[0]
    ok = [all(flags) for flags in zip(*(report.ok for report in reports))]
    return msgspec.structs.replace(
        first, ok=ok, nbytes=sum(report.nbytes for report in reports),
        duration_s=max(report.duration_s for report in reports),
        reason=next((report.reason for report in reports if report.reason), ""),
        retried=max(report.retried for report in reports), recovered=min(report.recovered for report in reports),
        kept=min(report.used_blocks for report in reports), transfers=None)


class LayerWritten(msgspec.Struct, frozen=True, kw_only=True):
    """Timing of one push write in the model worker, in seconds since the push's first
    write was queued: `computed_s` when the layer's KV was final (vLLM's save hook), then
    the write's start and end on the writer thread. `layer` -1: whole (reused) blocks."""

    layer: int
    blocks: int
    computed_s: float
    started_s: float
    done_s: float
    ok: bool


class Pushed(msgspec.Struct, frozen=True, kw_only=True, tag="pushed"):
    """The one outcome of a push, sent by the writer's worker side in the step that
    computed the prompt's last token, before that step's output."""

    transfer_id: str
    ok: list[bool]  # per target block: every layer written
    # per target block and KV head of `heads`, of the writer rank's own copy (0 where not written)
    checksums: list[int]
    nbytes: int = 0
    reason: str = ""
    writes: list[LayerWritten] = []
    rank: int = 0
    heads: list[int] = []  # the KV heads this rank's checksums are of
    transfers: RankTransfers | None = None  # the rank's agent's counters as it sent this (None: older sender)


def merge_pushed(reports: list[Pushed], num_kv_heads: int) -> Pushed:
    """The push's outcome over every writer rank: a block is written where every rank wrote
    its share; its checksums per KV head, from the rank that holds each head. Counters stay
    with each rank's own report."""
    first = reports[0]
    blocks = len(first.ok)
    checksums = [0] * (blocks * num_kv_heads)
    for report in reports:
        width = len(report.heads)
        for block in range(blocks):
            for column, head in enumerate(report.heads):
                checksums[block * num_kv_heads + head] = report.checksums[block * width + column]
    return msgspec.structs.replace(
        first, ok=[all(flags) for flags in zip(*(report.ok for report in reports))], checksums=checksums,
        nbytes=sum(report.nbytes for report in reports),
        reason=next((report.reason for report in reports if report.reason), ""),
        writes=sorted((write for report in reports for write in report.writes), key=lambda w: (w.started_s, w.layer)),
        heads=list(range(num_kv_heads)), transfers=None)


Report = Pinned | Loaded | Pushed


class RankAgent(msgspec.Struct, frozen=True, kw_only=True):
    """One model-worker rank's KV, as `TandemWorkerExtension.tandem_agent_metadata` answers:
    where its blocks, layers and heads live, and its NIXL agent."""

    geometry: RankGeometry
    agent_name: str
    metadata: bytes  # the NIXL agent's metadata


class RankChecksums(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's checksums of some units (`connector.kv_checksums.unit_sums`): per unit,
    per KV head of `heads`."""

    heads: list[int]
    values: list[int]


class LoadSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One pull for the worker side to perform in this step (vLLM's asynchronous load: the
    request waits for it, unscheduled, and is reported finished once it is done)."""

    request_id: str  # vLLM's (internal) request id
    transfer_id: str
    lease_id: str
    agent_name: str
    agent_metadata: bytes  # the holder's `connector.kv_peer.KvPeer`
    remote_block_ids: list[int]  # the holder's blocks to read: the pull's units
    local_block_ids: list[int]  # vLLM's blocks they land in (another count when the block sizes differ)
    checksums: list[int]  # per holder block and KV head
    cached_blocks: int  # leading holder blocks not read (cached here)
    block_size: int = 0  # the holder's (0: this engine's)
    tokens: int = -1  # tokens read, from the first holder block on (-1: whole blocks)


class PushSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What one step writes of one push: each layer of the prompt blocks this step
    completes (`indices` into the target, with the local blocks), as vLLM computes that layer;
    on the prompt's last step (`final`) also the blocks reused from the prefix cache
    (`whole_*`, never computed here), then the outcome goes out (`Pushed`)."""

    request_id: str  # vLLM's (internal) request id
    transfer_id: str
    agent_name: str
    agent_metadata: bytes
    target_block_ids: list[int]
    indices: list[int]
    local_block_ids: list[int]
    whole_indices: list[int] = []
    whole_local_block_ids: list[int] = []
    final: bool = False


class TailCopy(msgspec.Struct, frozen=True, kw_only=True):
    """A push's partial last block, block `source` (every layer, whole), copied into the
    request's own block `target`, in the step's `start_load_kv`: vLLM's asynchronous load,
    reported finished once copied."""

    request_id: str
    source: int
    target: int


class HostCopy(msgspec.Struct, frozen=True, kw_only=True):
    """Copies between vLLM's KV blocks and the host tier's slots (`connector.vllm.host_slots`),
    pairwise: block `block_ids[i]` <-> slot `slots[i]`, every layer. A load (`request_id`
    set: vLLM's asynchronous load, reported finished once copied) runs in the step's
    `start_load_kv`, a save (no request id) after it in `wait_for_save`, both after the
    step's forward pass, when the blocks it computed are final."""

    block_ids: list[int]
    slots: list[int]
    request_id: str = ""


# ---- kv_transfer_params helpers -----------------------------------------------------------

def order_params(order: TransferOrder) -> dict[str, Any]:
    return {ORDER_KEY: msgspec.to_builtins(order)}


def control_params(order: ControlOrder) -> dict[str, Any]:
    return {CONTROL_KEY: msgspec.to_builtins(order)}


def held_params(held: Held) -> dict[str, Any]:
    return {HELD_KEY: msgspec.to_builtins(held)}


def _converted(params: dict[str, Any] | None, key: str, kind: Any) -> Any:
    if not params or key not in params:
        return None
    # bytes stay bytes through vLLM's msgpack; to_builtins/convert keep them as is.
    return msgspec.convert(params[key], kind)


def order_of(params: dict[str, Any] | None) -> TransferOrder | None:
    return _converted(params, ORDER_KEY, TransferOrder)


def control_of(params: dict[str, Any] | None) -> ControlOrder | None:
    return _converted(params, CONTROL_KEY, ControlOrder)


def held_of(params: dict[str, Any] | None) -> Held | None:
    return _converted(params, HELD_KEY, Held)


_report_encoder = msgspec.msgpack.Encoder()
_report_decoder = msgspec.msgpack.Decoder(Report)


def encode_report(report: Report) -> bytes:
    return _report_encoder.encode(report)


def decode_report(payload: bytes) -> Report:
    return _report_decoder.decode(payload)
