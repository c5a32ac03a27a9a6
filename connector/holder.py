"""Holder side of the KV hand-off: grants leases on cached blocks and serves agent metadata.

Runs inside a worker (adapter: NATS request/reply on `kv.lease.<worker>`, and on
`kv.release.<worker>` for releases only, the router's). `LeaseHolder`
is the protocol, the same for every engine: the pure `LeaseTable` decides lifetimes, a
sweep ends expired leases (so a reader that died never holds blocks for long), and each
message is answered in its own task, so a release never queues behind a prefix grant that
waits for the engine. Every message that asks for a reply gets exactly one: a malformed
one, a TTL out of range (`MAX_LEASE_TTL_S`) or a failure while answering is an explicit
`LeaseRefused`. An engine plugs in three hooks: pin a prefix for a `LeaseRequest`
(`grant_prefix`), unpin the blocks of ended leases (`_unpin`), and name its NIXL agent
(`agent_name`, `agent_metadata`).

`connector.sim.holder.KvHolder` is the sim engine's: it pins and unpins through the
engine's `KvPort`, a call. `connector.vllm.holder.VllmKvHolder` is vLLM's: pinning is a
message to its process.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from collections.abc import Callable

from nats.aio.msg import Msg
from opentelemetry.trace import SpanKind

from connector.leases import Lease, LeaseTable
from connector.spans import tracer
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
    LeaseReply,
    LeaseRequest,
)
from shared.subjects import Subjects
from shared.tracing import extract_context, has_trace_context

log = logging.getLogger(__name__)
MAX_LEASE_TTL_S = 300.0  # a reader asking to pin blocks longer is refused (a NaN TTL would pin them for ever)
_SPAN_NAMES = {LeaseRequest: "kv.lease.request", LeaseRelease: "kv.lease.release", LeaseExtend: "kv.lease.extend",
               AgentInfoRequest: "kv.agent_info"}


class LeaseHolder(abc.ABC):
    def __init__(self, worker_id: str, bus: Bus, subjects: Subjects, *, compat_hash: str, block_size: int,
                 lease_ttl_s: float, sweep_interval_s: float = 0.1, malformed: MalformedCounter | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.worker_id = worker_id
        self._bus = bus
        self._subjects = subjects
        self.compat_hash = compat_hash
        self.block_size = block_size
        self.lease_ttl_s = lease_ttl_s
        self._sweep_interval_s = sweep_interval_s
        self._clock = clock
        self.leases = LeaseTable(worker_id)
        self._codec: Codec[LeaseMessage] = Codec(LeaseMessage, malformed)
        self._subscription = None
        self._release_subscription = None
        self._sweeper: asyncio.Task[None] | None = None
        self._answering: set[asyncio.Task] = set()

    # ---- engine hooks -----------------------------------------------------------------

    @abc.abstractmethod
    async def grant_prefix(self, reader_worker_id: str, block_hashes: list[int], ttl_s: float) -> KvHandle | None:
        """Pin the longest prefix of `block_hashes` still cached under a new lease (`_lease`);
        None if there is none. A `TandemError` refuses the request with its code."""

    @abc.abstractmethod
    def _unpin(self, ended: list[Lease]) -> None:
        """Let the engine reuse the blocks of these ended leases."""

    @property
    @abc.abstractmethod
    def agent_name(self) -> str:
        """The NIXL agent readers read this worker's blocks through."""

    @abc.abstractmethod
    def agent_metadata(self) -> bytes:
        """What a reader's agent needs to add this worker's agent as a peer."""

    # ---- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        self._subscription = await self._bus.client.subscribe(self._subjects.kv_lease(self.worker_id),
                                                              cb=self._on_message)
        # releases only, from outside the workers (the router's): NATS lets only workers ask for leases
        self._release_subscription = await self._bus.client.subscribe(self._subjects.kv_release(self.worker_id),
                                                                      cb=self._on_message)
        self._sweeper = asyncio.create_task(self._sweep_forever(), name=f"lease-sweep:{self.worker_id}")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        for subscription in (self._subscription, self._release_subscription):
            if subscription is not None:
                await subscription.unsubscribe()
        await asyncio.gather(*self._answering, return_exceptions=True)
        self.leases.cancel_all()
        self._settle()

    # ---- leases -----------------------------------------------------------------------

    def _lease(self, reader_worker_id: str, block_ids: list[int], block_hashes: list[int], checksums: list[int],
               ttl_s: float) -> KvHandle:
        """Lease blocks the engine just pinned; the handle is what the reader pulls with."""
        lease = self.leases.grant(reader_worker_id, block_ids, ttl_s, self._clock())
        tracer.start_span("kv.lease.grant", attributes={  # a moment: under whatever span is current
            "tandem.kv.lease_id": lease.lease_id, "tandem.kv.holder_worker_id": self.worker_id,
            "tandem.kv.reader_worker_id": reader_worker_id, "tandem.kv.blocks": len(block_ids),
            "tandem.kv.lease_ttl_s": ttl_s}).end()
        return KvHandle(holder_worker_id=self.worker_id, agent_name=self.agent_name, lease_id=lease.lease_id,
                        compat_hash=self.compat_hash, block_size=self.block_size, block_ids=list(block_ids),
                        block_hashes=block_hashes[: len(block_ids)], checksums=list(checksums), ttl_s=ttl_s)

    def release(self, lease_id: str, outcome) -> bool:
        released = self.leases.release(lease_id, outcome) is not None
        self._settle()
        return released

    def _settle(self) -> None:
        """Unpin the blocks of every lease that ended."""
        ended = self.leases.take_ended()
        if ended:
            self._unpin(ended)
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
        # Prefix grants may wait for the engine; answering in a task keeps releases from queueing behind them.
        task = asyncio.create_task(self._reply(msg))
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)

    async def _reply(self, msg: Msg) -> None:
        """Exactly one answer to every message that asks for one, whatever it holds."""
        try:
            reply = await self._handle(msg)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # a bug or a hostile message: refuse explicitly, never stay silent
            log.warning("lease message on %s failed: %r", msg.subject, error)
            reply = LeaseRefused(reason=f"{self.worker_id} could not handle the lease message: {type(error).__name__}",
                                 code=ErrorCode.INTERNAL.value)
        if msg.reply:
            try:
                await self._bus.client.publish(msg.reply, encode(reply))
            except Exception as error:  # the reader's own timeout reports it
                log.debug("could not answer a lease message: %s", error)

    async def _handle(self, msg: Msg) -> LeaseReply:
        message = self._codec.decode_or_none(msg.data, msg.subject)
        if message is None:
            reply = LeaseRefused(reason="malformed lease message", code=ErrorCode.INVALID_ARGUMENT.value)
        elif msg.subject == self._subjects.kv_release(self.worker_id) and not isinstance(message, LeaseRelease):
            reply = LeaseRefused(reason="only lease releases are taken on the release subject",
                                 code=ErrorCode.INVALID_ARGUMENT.value)
        elif has_trace_context(msg.headers):  # a request's message: its handling joins the request's trace
            with tracer.start_as_current_span(_SPAN_NAMES.get(type(message), "kv.lease"),
                                              context=extract_context(msg.headers), kind=SpanKind.SERVER,
                                              attributes={"tandem.kv.holder_worker_id": self.worker_id}) as span:
                reply = await self._answer(message)
                span.set_attribute("tandem.kv.reply", type(reply).__name__)
                if isinstance(message, LeaseRelease):
                    span.set_attributes({"tandem.kv.lease_id": message.lease_id, "tandem.kv.outcome": message.outcome,
                                         "tandem.kv.failed_blocks": list(message.failed_blocks)})
        else:
            reply = await self._answer(message)
        return reply

    async def _answer(self, message: LeaseMessage):
        match message:
            case LeaseRequest(ttl_s=ttl) | LeaseExtend(ttl_s=ttl) if not 0 < ttl <= MAX_LEASE_TTL_S:  # NaN too
                return LeaseRefused(reason=f"a lease's TTL must lie in (0, {MAX_LEASE_TTL_S:g}] seconds, got {ttl}",
                                    code=ErrorCode.INVALID_ARGUMENT.value)
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
                return AgentInfo(worker_id=self.worker_id, agent_name=self.agent_name,
                                 compat_hash=self.compat_hash, metadata=self.agent_metadata())

