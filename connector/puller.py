"""Reader side of the KV hand-off: lease (or take a handle), pull, verify, commit, release.

Used by a worker before it computes a request: the decode worker of a P/D pair pulls the
prompt's blocks from the prefill worker; any worker may pull a cached prefix from the
worker that holds it. Blocks that fail to arrive or to verify are simply not committed,
so the engine computes exactly those. Every pull ends with one explicit outcome, sent to
the holder as a `LeaseRelease` and published as a `TransferRecord`.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from connector.transport import KvTransport, TransferResult
from services.worker.engine import KvPort
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
    TransferRecord,
)
from shared.subjects import Subjects

log = logging.getLogger(__name__)


class PullOutcome(msgspec.Struct, kw_only=True):
    """What a pull left behind for the request: blocks to unpin when it ends, and counts."""

    pinned_block_ids: list[int]
    record: TransferRecord | None = None

    @property
    def pulled_tokens(self) -> int:
        return self.record.pulled_tokens if self.record else 0

    @property
    def recomputed_tokens(self) -> int:
        return self.record.recomputed_tokens if self.record else 0


class KvPuller:
    def __init__(self, worker_id: str, bus: Bus, subjects: Subjects, port: KvPort, transport: KvTransport, *,
                 compat_hash: str, block_size: int, control_timeout_s: float = 2.0,
                 transfer_timeout_s: float = 10.0, lease_ttl_s: float = 10.0) -> None:
        self.worker_id = worker_id
        self._bus = bus
        self._subjects = subjects
        self._port = port
        self._transport = transport
        self.compat_hash = compat_hash
        self.block_size = block_size
        self._control_timeout_s = control_timeout_s
        self._transfer_timeout_s = transfer_timeout_s
        self._lease_ttl_s = lease_ttl_s
        self._replies: Codec[LeaseReply] = Codec(LeaseReply)
        self._tasks: set[asyncio.Task] = set()  # releases sent after a cancellation
        self._adding: dict[str, asyncio.Future[bool]] = {}  # agent name -> metadata fetch in flight

    # ---- control messages to the holder -----------------------------------------------

    async def _ask(self, holder: str, message: msgspec.Struct) -> LeaseReply | None:
        try:
            reply = await self._bus.client.request(self._subjects.kv_lease(holder), encode(message),
                                                   timeout=self._control_timeout_s)
        except Exception as error:  # no responders, timeout, connection: the holder is unreachable
            log.info("%s: no answer from %s: %s", self.worker_id, holder, error)
            return None
        return self._replies.decode_or_none(reply.data, reply.subject)

    async def lease_prefix(self, holder: str, block_hashes: list[int]) -> KvHandle | None:
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
        if self._transport.has_peer(agent_name):
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
            self._transport.add_peer(reply.agent_name, reply.metadata)  # replaces a stale peer of that name
        except Exception as error:  # e.g. it died after answering: unreachable, like no answer at all
            log.warning("%s: cannot connect to %s's agent %s: %s", self.worker_id, worker_id, agent_name, error)
            return False
        return True

    # ---- the pull ---------------------------------------------------------------------

    def check_compatible(self, handle: KvHandle) -> None:
        if handle.compat_hash != self.compat_hash or handle.block_size != self.block_size:
            raise InvalidArgument(
                f"KV layout mismatch: blocks from {handle.holder_worker_id} have compatibility hash "
                f"{handle.compat_hash} (block size {handle.block_size}), {self.worker_id} has "
                f"{self.compat_hash} (block size {self.block_size}); refused before any transfer")

    async def pull(self, request_id: str, handle: KvHandle, token_ids: list[int], *, kind: str = "pull") -> PullOutcome:
        """Bring the handle's blocks into the local cache; always releases the lease."""
        started = time.monotonic()
        try:
            self.check_compatible(handle)
        except InvalidArgument:
            await self.release(handle, "refused")
            raise
        wanted = min(len(handle.block_ids), len(token_ids) // self.block_size)
        local = self._port.pin_prefix(handle.block_hashes[:wanted])  # already cached here: not pulled
        pinned = [block_id for block_id, _ in local]
        first = len(local)
        count = wanted - first
        if count <= 0:
            await self.release(handle, "done")
            return PullOutcome(pinned_block_ids=pinned, record=self._record(
                request_id, handle, kind, "done", 0, 0, 0, started, reason="already cached"))
        targets = self._port.allocate_for_transfer(count)
        if targets is None:
            await self.release(handle, "cancelled")
            return PullOutcome(pinned_block_ids=pinned, record=self._record(
                request_id, handle, kind, "cancelled", count, 0, 0, started, reason="no free blocks"))
        try:
            if not await self.ensure_agent(handle.holder_worker_id, handle.agent_name):
                result = TransferResult(outcome="failed", ok=[False] * count, reason="holder unreachable")
            else:
                result = await self._transport.read(handle.agent_name, handle.block_ids[first:wanted], targets,
                                                    timeout_s=self._transfer_timeout_s)
        except asyncio.CancelledError:  # the request was cancelled mid-pull: give everything back
            self._port.unpin(pinned + targets)
            self._background(self.release(handle, "cancelled"))
            raise
        ok = [landed and self._port.checksum(block_id) == handle.checksums[first + i]
              for i, (landed, block_id) in enumerate(zip(result.ok, targets))]
        landed_failed = [first + i for i, good in enumerate(ok) if not good]
        lease_held = await self.release(handle, "done" if not landed_failed else "failed", landed_failed)
        if lease_held is False:  # expired under us: what we read may be another request's KV
            ok = [False] * count
            result = TransferResult(outcome="failed", ok=ok, reason="lease expired before the pull ended")
        parent = handle.block_hashes[first - 1] if first else None
        committed = self._port.commit_transferred(targets, handle.block_hashes[first:wanted],
                                                  token_ids[first * self.block_size: wanted * self.block_size],
                                                  parent, ok)
        failed = [first + i for i, good in enumerate(committed) if not good]
        self._port.unpin([block_id for block_id, good in zip(targets, committed) if not good])
        pinned += [block_id for block_id, good in zip(targets, committed) if good]
        outcome: TransferOutcome = "done" if not failed else ("expired" if lease_held is False else "failed")
        reason = result.reason or (f"{len(failed)} block(s) failed verification" if failed else "")
        if failed:
            log.warning("%s: pull of %s from %s: %d of %d block(s) failed (%s); they will be computed",
                        self.worker_id, request_id, handle.holder_worker_id, len(failed), count, reason)
        return PullOutcome(pinned_block_ids=pinned, record=self._record(
            request_id, handle, kind, outcome, count, count - len(failed), result.nbytes, started, reason=reason))

    def _background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _record(self, request_id: str, handle: KvHandle, kind: str, outcome: TransferOutcome, blocks: int,
                blocks_ok: int, nbytes: int, started: float, *, reason: str = "") -> TransferRecord:
        return TransferRecord(worker_id=self.worker_id, request_id=request_id, kind=kind,  # type: ignore[arg-type]
                              peer_worker_id=handle.holder_worker_id, outcome=outcome, blocks=blocks,
                              blocks_ok=blocks_ok, bytes=nbytes, duration_s=time.monotonic() - started,
                              pulled_tokens=blocks_ok * self.block_size,
                              recomputed_tokens=(blocks - blocks_ok) * self.block_size, reason=reason)
