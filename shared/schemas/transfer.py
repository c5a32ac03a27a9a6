"""KV hand-off protocol: leases, agent metadata, and the transfer parameters of a request.

The holder of KV blocks grants a *lease*: the blocks are pinned (never evicted or reused)
until the reader releases the lease or it expires. The reader pulls the blocks with NIXL
READ and then releases with an explicit outcome. Every hand-off therefore ends in exactly
one outcome on both sides: done, failed (with which blocks), cancelled or expired.

Lease traffic is request/reply on the holder's `kv.lease.<worker>` subject:
`LeaseRequest` -> `LeaseGrant` | `LeaseRefused`; `LeaseRelease` / `LeaseExtend` -> `LeaseAck`;
`AgentInfoRequest` -> `AgentInfo` (NIXL agent metadata, ~0.5 KB, travels as bytes). Only
workers may send there; the router releases the leases it arranged on `kv.release.<worker>`,
which takes `LeaseRelease` only.

Every message carries the sender's compatibility hash: a mismatch is refused before any
byte moves.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from shared.schemas.common import Message

TransferOutcome = Literal["done", "failed", "cancelled", "expired", "refused"]


class KvTail(msgspec.Struct, kw_only=True, frozen=True):
    """A prompt's last, partial block, held after its full blocks for the same request's
    decode part: it has no chain hash (only full blocks are indexed or shared), so only a
    reader continuing that prompt may use it."""

    block_id: int
    checksum: int = 0  # unused since connector protocol 2 (`checksums`)
    tokens: int  # prompt tokens it holds, 0 < tokens < block_size
    checksums: list[int] = []  # per KV head, over its tokens (`connector.kv_checksums`)


class KvHandle(msgspec.Struct, kw_only=True, frozen=True):
    """Blocks a holder keeps for a reader, under `lease_id`, in token order."""

    holder_worker_id: str
    agent_name: str
    lease_id: str
    compat_hash: str
    block_size: int
    block_ids: list[int]  # in the holder's pool
    block_hashes: list[int]  # Tandem's chain hashes, one per block
    # per block and KV head, block by block (`connector.kv_checksums`): the reader, of any
    # shape, verifies what it got
    checksums: list[int]
    ttl_s: float
    tail: KvTail | None = None  # after the full blocks (a P/D hand-off of a vLLM prefill)

    @property
    def num_tokens(self) -> int:
        return len(self.block_ids) * self.block_size + (self.tail.tokens if self.tail is not None else 0)


class PushTarget(msgspec.Struct, kw_only=True, frozen=True):
    """Blocks a reader allocated for a writer to fill, layer by layer (push mode)."""

    reader_worker_id: str
    agent_name: str
    transfer_id: str
    compat_hash: str
    block_ids: list[int]  # in the reader's pool, one per full prompt block


class KvTransferParams(msgspec.Struct, kw_only=True, frozen=True):
    """How a generate request takes part in a KV hand-off. All fields optional.

    - `hold_for_decode` (prefill worker): after prefill, keep the prompt's full blocks
      under a lease and return its `KvHandle` in the `Finished` frame.
    - `source` (decode worker): pull these blocks instead of computing them.
    - `prefix_holder` + `prefix_hashes` (any worker): ask that worker for a lease on the
      longest prefix of these block hashes it still holds, pull what is not cached here,
      compute the rest (cluster prefix pull, e.g. turn 2 of a conversation).
    - `push_to` (prefill worker): write the prompt's KV into the reader's blocks layer by
      layer as it is computed, then notify the reader with `PushDone`.
    - `await_push` (decode worker): allocate blocks, answer with a `KvTarget` frame, and
      wait (bounded) for the writer's `PushDone`.
    """

    hold_for_decode: bool = False
    source: KvHandle | None = None
    prefix_holder: str | None = None
    prefix_hashes: list[int] = []
    push_to: PushTarget | None = None
    await_push: bool = False


class LeaseRequest(Message, tag="lease_request", kw_only=True):
    requester_worker_id: str
    compat_hash: str
    block_hashes: list[int]  # the holder grants the longest prefix it holds
    ttl_s: float


class LeaseGrant(Message, tag="lease_grant", kw_only=True):
    handle: KvHandle


class LeaseRefused(Message, tag="lease_refused", kw_only=True):
    reason: str
    code: str  # an ErrorCode value


class LeaseRelease(Message, tag="lease_release", kw_only=True):
    lease_id: str
    outcome: TransferOutcome
    failed_blocks: list[int] = []  # indices into the handle's block list


class LeaseExtend(Message, tag="lease_extend", kw_only=True):
    lease_id: str
    ttl_s: float


class LeaseAck(Message, tag="lease_ack", kw_only=True):
    lease_id: str
    ok: bool
    reason: str = ""


class AgentInfoRequest(Message, tag="agent_info_request", kw_only=True):
    requester_worker_id: str
    compat_hash: str


class AgentInfo(Message, tag="agent_info", kw_only=True):
    worker_id: str
    agent_name: str
    compat_hash: str
    metadata: bytes


class PushDone(Message, tag="push_done", kw_only=True):
    """Writer -> reader (reader's control subject): the pushed blocks and their checksums."""

    transfer_id: str
    outcome: TransferOutcome
    checksums: list[int]
    first_token: int | None = None
    failed_blocks: list[int] = []


LeaseMessage = LeaseRequest | LeaseRelease | LeaseExtend | AgentInfoRequest
LeaseReply = LeaseGrant | LeaseRefused | LeaseAck | AgentInfo


TransferKind = Literal["pull", "push", "prefix_pull"]


class TransferRecord(Message, tag="transfer_record", kw_only=True):
    """One hand-off as seen by the reader (published on `kv.transfers.<worker>`)."""

    worker_id: str
    request_id: str
    kind: TransferKind
    peer_worker_id: str
    outcome: TransferOutcome
    blocks: int  # blocks asked for
    blocks_ok: int  # blocks that arrived and verified
    bytes: int
    duration_s: float
    pulled_tokens: int
    recomputed_tokens: int  # tokens of blocks that were meant to arrive but were computed
    reason: str = ""
    blocks_retried: int = 0  # blocks read again after a failed read or verification
    blocks_recovered: int = 0  # of those, blocks that then arrived and verified
