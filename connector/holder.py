"""Holder side of the KV hand-off: grants leases on cached blocks and serves agent metadata.

Runs inside a worker (adapter: NATS request/reply on `kv.lease.<worker>`). Pinning and
unpinning go through the engine's `KvPort`; the pure `LeaseTable` decides lifetimes. A
sweep ends expired leases, so a reader that died never holds blocks for long.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from nats.aio.msg import Msg

from connector.leases import LeaseTable
from connector.transport import KvTransport
from services.worker.engine import KvPort
from shared.bus import Bus
from shared.codec import Codec, MalformedCounter, encode
from shared.errors import ErrorCode
from shared.schemas.transfer import (
    AgentInfo,
    AgentInfoRequest,
    KvHandle,
    LeaseAck,
    LeaseExtend,
    LeaseGrant,
    LeaseMessage,
    LeaseRefused,
    LeaseRelease,
    LeaseRequest,
)
from shared.subjects import Subjects

log = logging.getLogger(__name__)


class KvHolder:
    def __init__(self, worker_id: str, bus: Bus, subjects: Subjects, port: KvPort, transport: KvTransport, *,
                 compat_hash: str, block_size: int, lease_ttl_s: float, sweep_interval_s: float = 0.1,
                 malformed: MalformedCounter | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.worker_id = worker_id
        self._bus = bus
        self._subjects = subjects
        self._port = port
        self._transport = transport
        self.compat_hash = compat_hash
        self.block_size = block_size
        self.lease_ttl_s = lease_ttl_s
        self._sweep_interval_s = sweep_interval_s
        self._clock = clock
        self.leases = LeaseTable(worker_id)
        self._codec: Codec[LeaseMessage] = Codec(LeaseMessage, malformed)
        self._subscription = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._subscription = await self._bus.client.subscribe(self._subjects.kv_lease(self.worker_id),
                                                              cb=self._on_message)
        self._sweeper = asyncio.create_task(self._sweep_forever(), name=f"lease-sweep:{self.worker_id}")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        if self._subscription is not None:
            await self._subscription.unsubscribe()
        self.leases.cancel_all()
        self._settle()

    # ---- granting -------------------------------------------------------------------

    def grant(self, reader_worker_id: str, block_hashes: list[int], ttl_s: float | None = None) -> KvHandle | None:
        """Pin the longest cached prefix of `block_hashes` under a new lease; None if nothing is cached."""
        pinned = self._port.pin_prefix(block_hashes)
        if not pinned:
            return None
        ttl = self.lease_ttl_s if ttl_s is None else ttl_s
        block_ids = [block_id for block_id, _ in pinned]
        lease = self.leases.grant(reader_worker_id, block_ids, ttl, self._clock())
        return KvHandle(holder_worker_id=self.worker_id, agent_name=self._transport.agent_name,
                        lease_id=lease.lease_id, compat_hash=self.compat_hash, block_size=self.block_size,
                        block_ids=block_ids, block_hashes=block_hashes[: len(block_ids)],
                        checksums=[checksum for _, checksum in pinned], ttl_s=ttl)

    def release(self, lease_id: str, outcome) -> bool:
        released = self.leases.release(lease_id, outcome) is not None
        self._settle()
        return released

    def _settle(self) -> None:
        """Unpin the blocks of every lease that ended."""
        for lease in self.leases.take_ended():
            self._port.unpin(lease.block_ids)
            if lease.outcome == "expired":
                log.warning("lease %s for %s expired before release: blocks unpinned",
                            lease.lease_id, lease.reader_worker_id)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self._sweep_interval_s)
            self.leases.expire(self._clock())
            self._settle()

    # ---- request/reply --------------------------------------------------------------

    async def _on_message(self, msg: Msg) -> None:
        message = self._codec.decode_or_none(msg.data, msg.subject)
        reply = self._answer(message) if message is not None else LeaseRefused(
            reason="malformed lease message", code=ErrorCode.INVALID_ARGUMENT.value)
        if msg.reply:
            await self._bus.client.publish(msg.reply, encode(reply))

    def _answer(self, message):
        match message:
            case LeaseRequest() if message.compat_hash != self.compat_hash:
                return self._mismatch(message.compat_hash)
            case LeaseRequest(requester_worker_id=reader, block_hashes=hashes, ttl_s=ttl):
                handle = self.grant(reader, hashes, ttl)
                if handle is None:
                    return LeaseRefused(reason=f"{self.worker_id} holds none of these blocks any more",
                                        code=ErrorCode.NOT_FOUND.value)
                return LeaseGrant(handle=handle)
            case LeaseRelease(lease_id=lease_id, outcome=outcome):
                ok = self.release(lease_id, outcome)
                return LeaseAck(lease_id=lease_id, ok=ok, reason="" if ok else "lease already ended")
            case LeaseExtend(lease_id=lease_id, ttl_s=ttl):
                ok = self.leases.extend(lease_id, ttl, self._clock())
                return LeaseAck(lease_id=lease_id, ok=ok, reason="" if ok else "lease already ended")
            case AgentInfoRequest() if message.compat_hash != self.compat_hash:
                return self._mismatch(message.compat_hash)
            case AgentInfoRequest():
                return AgentInfo(worker_id=self.worker_id, agent_name=self._transport.agent_name,
                                 compat_hash=self.compat_hash, metadata=self._transport.metadata())

    def _mismatch(self, theirs: str) -> LeaseRefused:
        return LeaseRefused(reason=f"KV layout mismatch: {self.worker_id} has compatibility hash "
                                   f"{self.compat_hash}, the reader {theirs}", code=ErrorCode.INVALID_ARGUMENT.value)
