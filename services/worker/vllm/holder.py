"""Holder side of the KV hand-off for a vLLM engine: leases on blocks vLLM keeps referenced.

The same protocol as `connector.holder.KvHolder` (NATS request/reply on `kv.lease.<worker>`,
`connector.leases.LeaseTable` for lifetimes, a sweep that ends expired leases), but the
blocks live in vLLM's processes, so pinning is a message to the engine, not a call:

- a hold (`grant_held`): vLLM pinned the prompt's blocks when the prefill finished; the
  lease adopts that pin;
- a prefix lease (`LeaseRequest`): the tokens of the longest prefix the KV-event mirror
  knows are sent to vLLM as a pin control request; vLLM pins what is really still cached
  (the mirror may lag) and the lease covers that;
- a lease that ends (released, expired, cancelled at stop) unpins its key in vLLM.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from nats.aio.msg import Msg

from connector.leases import LeaseTable
from shared.bus import Bus
from shared.codec import Codec, MalformedCounter, encode
from shared.errors import ErrorCode, TandemError
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

if TYPE_CHECKING:
    from services.worker.vllm.engine import VllmEngine
    from services.worker.vllm.kv_link import HeldBlocks

log = logging.getLogger(__name__)


class VllmKvHolder:
    def __init__(self, worker_id: str, bus: Bus, subjects: Subjects, engine: VllmEngine, *, compat_hash: str,
                 block_size: int, lease_ttl_s: float, sweep_interval_s: float = 0.1,
                 malformed: MalformedCounter | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.worker_id = worker_id
        self._bus = bus
        self._subjects = subjects
        self._engine = engine
        self.compat_hash = compat_hash
        self.block_size = block_size
        self.lease_ttl_s = lease_ttl_s
        self._sweep_interval_s = sweep_interval_s
        self._clock = clock
        self.leases = LeaseTable(worker_id)
        self._pin_keys: dict[str, str] = {}  # lease id -> the key vLLM pinned its blocks under
        self._prefix_ids = itertools.count(1)
        self._codec: Codec[LeaseMessage] = Codec(LeaseMessage, malformed)
        self._subscription = None
        self._sweeper: asyncio.Task[None] | None = None
        self._answering: set[asyncio.Task] = set()

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
        await asyncio.gather(*self._answering, return_exceptions=True)
        self.leases.cancel_all()
        self._settle()

    # ---- granting -------------------------------------------------------------------

    def grant_held(self, reader_worker_id: str, held: HeldBlocks, block_hashes: list[int]) -> KvHandle:
        """Adopt the pin vLLM took when a prefill finished; the lease now decides its end."""
        return self._lease(reader_worker_id, held.key, held.block_ids, block_hashes, held.checksums,
                           self.lease_ttl_s)

    async def grant_prefix(self, reader_worker_id: str, block_hashes: list[int], ttl_s: float) -> KvHandle | None:
        """Pin the longest prefix of `block_hashes` still cached in vLLM; None if there is none."""
        tokens = self._engine.kv_event_bridge.mirror.prefix_tokens(block_hashes)
        if not tokens:
            return None
        link = self._engine.kv_link
        key = f"{self.worker_id}-prefix-{next(self._prefix_ids)}"
        block_ids = await link.pin_prefix(key, tokens)
        if not block_ids:
            return None
        try:
            checksums = await link.checksums(block_ids)
        except BaseException:
            link.unpin_soon([key])
            raise
        return self._lease(reader_worker_id, key, block_ids, block_hashes, checksums, ttl_s)

    def _lease(self, reader_worker_id: str, key: str, block_ids: list[int], block_hashes: list[int],
               checksums: list[int], ttl_s: float) -> KvHandle:
        lease = self.leases.grant(reader_worker_id, block_ids, ttl_s, self._clock())
        self._pin_keys[lease.lease_id] = key
        return KvHandle(holder_worker_id=self.worker_id, agent_name=self._engine.kv_link.agent_name,
                        lease_id=lease.lease_id, compat_hash=self.compat_hash, block_size=self.block_size,
                        block_ids=list(block_ids), block_hashes=block_hashes[: len(block_ids)],
                        checksums=list(checksums), ttl_s=ttl_s)

    def release(self, lease_id: str, outcome) -> bool:
        released = self.leases.release(lease_id, outcome) is not None
        self._settle()
        return released

    def _settle(self) -> None:
        """Unpin the blocks of every lease that ended."""
        ended = self.leases.take_ended()
        keys = [self._pin_keys.pop(lease.lease_id) for lease in ended if lease.lease_id in self._pin_keys]
        if keys:
            self._engine.kv_link.unpin_soon(keys)
        for lease in ended:
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
        # Prefix grants wait for vLLM; answering in a task keeps releases from queueing behind them.
        task = asyncio.create_task(self._reply(msg))
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)

    async def _reply(self, msg: Msg) -> None:
        message = self._codec.decode_or_none(msg.data, msg.subject)
        if message is None:
            reply = LeaseRefused(reason="malformed lease message", code=ErrorCode.INVALID_ARGUMENT.value)
        else:
            reply = await self._answer(message)
        if msg.reply:
            try:
                await self._bus.client.publish(msg.reply, encode(reply))
            except Exception as error:  # the reader's own timeout reports it
                log.debug("could not answer a lease message: %s", error)

    async def _answer(self, message):
        match message:
            case LeaseRequest() | AgentInfoRequest() if message.compat_hash != self.compat_hash:
                return LeaseRefused(reason=f"KV layout mismatch: {self.worker_id} has compatibility hash "
                                           f"{self.compat_hash}, the reader {message.compat_hash}",
                                    code=ErrorCode.INVALID_ARGUMENT.value)
            case LeaseRequest(requester_worker_id=reader, block_hashes=hashes, ttl_s=ttl):
                try:
                    handle = await self.grant_prefix(reader, hashes, ttl)
                except TandemError as error:
                    return LeaseRefused(reason=f"{self.worker_id} could not pin blocks: {error.message}",
                                        code=error.code.value)
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
            case AgentInfoRequest():
                link = self._engine.kv_link
                return AgentInfo(worker_id=self.worker_id, agent_name=link.agent_name,
                                 compat_hash=self.compat_hash, metadata=link.agent_metadata)
