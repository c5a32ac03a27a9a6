"""Reader side of the lease protocol, the same for every engine: ask a holder for a prefix
lease, release a lease with its outcome, fetch a holder's agent metadata, check a handle's
compatibility before any byte moves.

One `LeaseClient` per worker data plane: the sim's (`connector.sim.worker_kv.WorkerKv`,
through `connector.puller.KvPuller`, which reads the blocks itself) and vLLM's
(`connector.vllm.worker_kv.VllmWorkerKv`, whose engine reads them); what a release says
is decided by `connector.pull.Pull`. Holders answer on
`kv.lease.<worker>` (`connector.holder.LeaseHolder`). Every wait is bounded by the control
timeout; an unreachable holder is a value (None, False), never an exception.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

import msgspec

from shared.bus import Bus
from shared.codec import Codec, encode
from shared.errors import InvalidArgument
from shared.schemas.transfer import (
    AgentInfo,
    AgentInfoRequest,
    KvHandle,
    LeaseAck,
    LeaseGrant,
    LeaseRefused,
    LeaseRelease,
    LeaseReply,
    LeaseRequest,
    TransferOutcome,
)
from shared.subjects import Subjects
from shared.tracing import inject_headers

log = logging.getLogger(__name__)


class PeerRegistry(Protocol):
    """Where a holder's agent metadata goes once fetched: a `KvTransport`, or, for an engine
    whose agent lives in another process, a record the engine's orders carry
    (`connector.vllm.worker_kv.PeerAgents`). `add_peer` raises for unusable metadata."""

    def has_peer(self, name: str) -> bool: ...

    def add_peer(self, name: str, metadata: bytes) -> None: ...


class LeaseClient:
    def __init__(self, worker_id: str, bus: Bus, subjects: Subjects, peers: PeerRegistry, *, compat_hash: str,
                 block_size: int, control_timeout_s: float = 2.0, lease_ttl_s: float = 10.0) -> None:
        self.worker_id = worker_id
        self._bus = bus
        self._subjects = subjects
        self._peers = peers
        self.compat_hash = compat_hash
        self.block_size = block_size
        self._control_timeout_s = control_timeout_s
        self._lease_ttl_s = lease_ttl_s
        self._replies: Codec[LeaseReply] = Codec(LeaseReply)
        self._adding: dict[str, asyncio.Future[bool]] = {}  # agent name -> metadata fetch in flight

    async def _ask(self, holder: str, message: msgspec.Struct) -> LeaseReply | None:
        try:
            reply = await self._bus.client.request(self._subjects.kv_lease(holder), encode(message),
                                                   timeout=self._control_timeout_s, headers=inject_headers() or None)
        except Exception as error:  # no responders, timeout, connection: the holder is unreachable
            log.info("%s: no answer from %s: %s", self.worker_id, holder, error)
            return None
        return self._replies.decode_or_none(reply.data, reply.subject)

    async def lease_prefix(self, holder: str, block_hashes: list[int]) -> KvHandle | None:
        """A lease on the longest prefix of `block_hashes` the holder still has; None if it
        has none, refuses, or does not answer."""
        reply = await self._ask(holder, LeaseRequest(requester_worker_id=self.worker_id, compat_hash=self.compat_hash,
                                                     block_hashes=block_hashes, ttl_s=self._lease_ttl_s))
        if isinstance(reply, LeaseGrant):
            return reply.handle
        if isinstance(reply, LeaseRefused):
            log.info("%s: %s refused a prefix lease: %s", self.worker_id, holder, reply.reason)
        return None

    async def release(self, handle: KvHandle, outcome: TransferOutcome, failed_blocks: list[int] = ()) -> bool | None:
        """Tell the holder we are done. True: the lease was still ours; False: it had already
        ended (expired), so the blocks may have been reused while we read them; None: no
        answer (the holder's lease expiry frees the blocks)."""
        reply = await self._ask(handle.holder_worker_id, LeaseRelease(lease_id=handle.lease_id, outcome=outcome,
                                                                      failed_blocks=list(failed_blocks)))
        return reply.ok if isinstance(reply, LeaseAck) else None

    async def ensure_agent(self, worker_id: str, agent_name: str) -> bool:
        """Make the worker's agent reachable; a new agent name means a restarted peer.

        Concurrent first pulls from one holder share one metadata fetch: re-adding a peer
        drops its connection, which would fail a transfer already running over it."""
        if self._peers.has_peer(agent_name):
            return True
        pending = self._adding.get(agent_name)
        if pending is None:
            pending = asyncio.ensure_future(self._add_agent(worker_id, agent_name))
            self._adding[agent_name] = pending
            pending.add_done_callback(lambda _: self._adding.pop(agent_name, None))
        return await asyncio.shield(pending)

    async def _add_agent(self, worker_id: str, agent_name: str) -> bool:
        reply = await self._ask(worker_id, AgentInfoRequest(requester_worker_id=self.worker_id,
                                                            compat_hash=self.compat_hash))
        if not isinstance(reply, AgentInfo) or reply.agent_name != agent_name:
            return False
        try:
            self._peers.add_peer(reply.agent_name, reply.metadata)  # replaces a stale peer of that name
        except Exception as error:  # e.g. it died after answering: unreachable, like no answer at all
            log.warning("%s: cannot connect to %s's agent %s: %s", self.worker_id, worker_id, agent_name, error)
            return False
        return True

    def check_compatible(self, handle: KvHandle) -> None:
        """Raise InvalidArgument for blocks whose KV means something else (another compatibility
        hash: `shared.compat`): refused before any transfer. Another block size of the same
        family, or another parallel layout, is mapped, not refused."""
        if handle.compat_hash != self.compat_hash:
            raise InvalidArgument(
                f"KV layout mismatch: blocks from {handle.holder_worker_id} have compatibility hash "
                f"{handle.compat_hash} (block size {handle.block_size}), {self.worker_id} has "
                f"{self.compat_hash} (block size {self.block_size}); refused before any transfer")

    async def refuse_if_incompatible(self, handle: KvHandle) -> None:
        """`check_compatible`, releasing the lease as "refused" before raising."""
        try:
            self.check_compatible(handle)
        except InvalidArgument:
            await self.release(handle, "refused")
            raise
