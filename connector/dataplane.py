"""The data-plane interface the worker service calls, and what both engines' data planes share.

`DataPlane` is the contract: `services/worker/service.py` (`WorkerService`) starts and
stops it, reads its counters for the load snapshot (and its ranks' transfer counters,
`rank_transfers()`, once per load interval) and hands it push messages; each
request's `connector.kv_session.KvSession` (opened by `RequestRunner`) calls, around the
engine's run:

- `prepare()` (pull what `kv_transfer` names), then `release_pins()` once the engine took
  the request, and again when it ends;
- `hold()` on the prefill's final output (lease its blocks for a decode worker), and
  `release_hold()` if the caller never saw the handle;
- push mode: `push_receiver()` + `await_push()` on the decode side; `push_writer()`,
  `ensure_push_peer()`, `send_push_done()` on the prefill side.

Implementations: `connector.sim.worker_kv.WorkerKv` (engines with an in-process `KvPort`)
and `connector.vllm.worker_kv.VllmWorkerKv` (blocks move inside vLLM). An engine's spec
builds its data plane (`build_data_plane`). Both derive from `LeasingDataPlane`: a lease
holder, the lease client, counters, transfer records published on `kv.transfers.<worker>`,
and the rules both engines follow the same way: which holder a request reads from
(`pull_source`) and what it reads (a P/D handle, or a lease of the prefix: `_pull_handle`),
the compatibility check of a push target and the reader's agent metadata
(`ensure_push_peer`), and the reader's half of a push (its receivers by transfer, the
bounded wait, the receipt, span and record; an unclaimed receiver expires and gives its
blocks back) and the writer's `push_done` message. What a hold leases is the request's
chain (`shared.schemas.generate.prompt_chain`). The engines supply where blocks live:
`_commit_push`, `_give_back`, `_block_nbytes` and `_push_writer`. How a pull is driven stays
each engine's own: in-process for the sim (`connector.puller`), inside vLLM's connector for
vLLM (the read happens in its model-worker processes, in the request's first step).
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from functools import partial
from typing import Generic, Protocol, TypeVar

from opentelemetry.trace import Span

from connector.holder import LeaseHolder
from connector.lease_client import LeaseClient, PeerRegistry
from connector.prepared import Prepared, TransferTotals
from connector.push import PushArrival, PushReceiver, PushWriter, wait_for_push
from connector.push_receipt import PushReceipt
from connector.spans import tracer, transfer_attributes
from shared.bus import Bus
from shared.codec import encode
from shared.config import KvTransferConfig
from shared.errors import InvalidArgument
from shared.schemas.generate import GenerateRequest
from shared.schemas.load import RankTransfers
from shared.schemas.transfer import (
    KvHandle,
    KvTransferParams,
    PushDone,
    PushTarget,
    TransferKind,
    TransferRecord,
)
from shared.subjects import Subjects
from shared.tracing import inject_headers

log = logging.getLogger(__name__)


class DataPlane(Protocol):
    @property
    def active_leases(self) -> int: ...

    @property
    def totals(self) -> TransferTotals:
        """Every request's transfer counts since the start, summed."""
        ...

    def rank_transfers(self) -> list[RankTransfers]:
        """Each KV rank's transfer counters, by rank, the latest known; never waits, never
        raises (the load snapshot calls it once per load interval)."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def prepare(self, request: GenerateRequest) -> Prepared:
        """Pull what the request's `kv_transfer` names; never raises for a failed transfer
        (the engine computes what did not arrive), only for a refused, incompatible handle."""
        ...

    def release_pins(self, prepared: Prepared) -> None:
        """After the engine took the request, and when it ends; idempotent."""
        ...

    def hold(self, request: GenerateRequest) -> KvHandle | None:
        """Lease the request's prompt blocks for a decode worker; call it on the final output,
        before awaiting anything (the blocks could be evicted)."""
        ...

    def release_hold(self, handle: KvHandle) -> None:
        """End a hold whose handle never reached the caller."""
        ...

    async def push_receiver(self, request: GenerateRequest) -> PushReceiver: ...

    async def await_push(self, request: GenerateRequest, receiver: PushReceiver) -> tuple[int, Prepared]: ...

    def deliver_push(self, message: PushDone) -> None: ...

    def push_writer(self, request: GenerateRequest, target: PushTarget) -> PushWriter: ...

    async def ensure_push_peer(self, target: PushTarget) -> bool: ...

    async def send_push_done(self, target: PushTarget, message: PushDone) -> None: ...


HolderT = TypeVar("HolderT", bound=LeaseHolder)
ReceiverT = TypeVar("ReceiverT", bound=PushArrival)
WriterT = TypeVar("WriterT")


class LeasingDataPlane(ABC, Generic[HolderT, ReceiverT, WriterT]):
    """What every engine's data plane shares: the holder it starts and stops, its lease
    count, the lease client (`leases`: other holders' leases and agent metadata, kept in
    `peers`), the transfer counters of the load snapshot, transfer records, and the halves of
    pulls and pushes that do not depend on where the engine's blocks live."""

    def __init__(self, worker_id: str, bus: Bus, subjects: Subjects, holder: HolderT, peers: PeerRegistry, *,
                 compat_hash: str, block_size: int, settings: KvTransferConfig) -> None:
        self.worker_id = worker_id
        self._bus = bus
        self._subjects = subjects
        self.holder = holder
        self.compat_hash = compat_hash
        self.block_size = block_size
        self.leases = LeaseClient(worker_id, bus, subjects, peers, compat_hash=compat_hash, block_size=block_size,
                                  control_timeout_s=settings.control_timeout_s, lease_ttl_s=settings.lease_ttl_s)
        self._push_wait_s = settings.push_wait_s
        self._receivers: dict[str, ReceiverT] = {}  # transfer id -> the reader's receiver, until its PushDone
        self._totals = TransferTotals()

    @property
    def active_leases(self) -> int:
        return self.holder.leases.active

    @property
    def totals(self) -> TransferTotals:
        return self._totals

    async def start(self) -> None:
        await self.holder.start()

    async def stop(self) -> None:
        await self.holder.stop()

    def release_hold(self, handle: KvHandle) -> None:
        self.holder.release(handle.lease_id, "cancelled")

    def pull_source(self, params: KvTransferParams) -> tuple[TransferKind, str] | None:
        """Which kind of pull a request's `kv_transfer` asks for, and from which holder: a P/D
        handle's, or a prefix holder other than this worker; None: nothing to read."""
        if params.source is not None:
            return "pull", params.source.holder_worker_id
        if params.prefix_holder and params.prefix_hashes and params.prefix_holder != self.worker_id:
            return "prefix_pull", params.prefix_holder
        return None

    @staticmethod
    def _pull_span(kind: TransferKind, holder: str) -> Span:
        """A pull's span, ended by the engine's data plane once the pull's outcome is known."""
        return tracer.start_span("kv.pull", attributes={"tandem.kv.kind": kind, "tandem.kv.peer_worker_id": holder})

    async def _pull_handle(self, params: KvTransferParams, holder: str, span: Span) -> KvHandle | None:
        """What a pull reads: the P/D handle it was given, or a lease of the prefix from its
        holder (None, marked on `span`: the holder leased nothing)."""
        handle = params.source or await self.leases.lease_prefix(holder, params.prefix_hashes)
        if handle is None:
            span.set_attribute("tandem.kv.outcome", "no_lease")
        return handle

    # ---- push mode: what both engines do alike ---------------------------------------------

    def _expect_push(self, receiver: ReceiverT) -> ReceiverT:
        """Register a new receiver for its `PushDone`. One that `await_push` never claims (the
        request failed before) gives its blocks back after twice the push wait."""
        self._receivers[receiver.target.transfer_id] = receiver
        asyncio.get_running_loop().call_later(2 * self._push_wait_s + 5.0, self._expire, receiver)
        return receiver

    def _expire(self, receiver: ReceiverT) -> None:
        if not receiver.claimed:
            self._receivers.pop(receiver.target.transfer_id, None)
            self._give_back(receiver)

    def deliver_push(self, message: PushDone) -> None:
        receiver = self._receivers.get(message.transfer_id)
        if receiver is not None:
            receiver.deliver(message)

    async def await_push(self, request: GenerateRequest, receiver: ReceiverT) -> tuple[int, Prepared]:
        """Wait (bounded) for the writer; keep what verified. Returns the first token (the writer's)."""
        receiver.claimed = True
        target = receiver.target
        with tracer.start_as_current_span("kv.push.receive", attributes={
                "tandem.kv.kind": "push", "tandem.kv.blocks": len(target.block_ids)}) as span:
            started = time.monotonic()
            try:
                message = await wait_for_push(receiver.done, self._push_wait_s, partial(self._give_back, receiver))
            finally:
                self._receivers.pop(target.transfer_id, None)
            assert message.first_token is not None
            receipt = PushReceipt(self.worker_id, request.request_id, message, target.block_ids,
                                  block_size=self.block_size, block_nbytes=self._block_nbytes, started=started,
                                  prompt_tokens=len(request.token_ids))
            prepared = await self._commit_push(request, receiver, receipt)
            receipt.log_failures()
            record = receipt.record()
            span.set_attributes(receipt.span_attributes())
            span.set_attributes(transfer_attributes(record))
        self._count(prepared)
        await self._publish(record)
        return message.first_token, prepared

    @abstractmethod
    async def _commit_push(self, request: GenerateRequest, receiver: ReceiverT, receipt: PushReceipt) -> Prepared:
        """Verify what arrived and keep the leading verified blocks for the request (into
        `receipt`); give back the rest."""

    @abstractmethod
    def _give_back(self, receiver: ReceiverT) -> None:
        """Unpin a receiver's target blocks: no push will come into them."""

    @property
    @abstractmethod
    def _block_nbytes(self) -> int:
        """One block of the whole model (every layer and head once), for transfer records."""

    def push_writer(self, request: GenerateRequest, target: PushTarget) -> WriterT:
        """Prefill side: a writer of the request's KV into `target`, refused if its layout is not this
        worker's."""
        if target.compat_hash != self.compat_hash:
            raise InvalidArgument(f"KV layout mismatch: the reader {target.reader_worker_id} has compatibility "
                                  f"hash {target.compat_hash}, {self.worker_id} has {self.compat_hash}")
        return self._push_writer(request, target)

    @abstractmethod
    def _push_writer(self, request: GenerateRequest, target: PushTarget) -> WriterT:
        """The engine's writer of a checked target."""

    async def ensure_push_peer(self, target: PushTarget) -> bool:
        """Writer side: the reader's agent metadata is known (fetched once, into `peers`);
        False when the reader cannot be reached."""
        return await self.leases.ensure_agent(target.reader_worker_id, target.agent_name)

    async def send_push_done(self, target: PushTarget, message: PushDone) -> None:
        await self._bus.client.publish(self._subjects.control(target.reader_worker_id, "push_done"), encode(message),
                                       headers=inject_headers() or None)

    def _count(self, prepared: Prepared) -> None:
        self._totals.count(prepared)

    async def _publish(self, record: TransferRecord) -> None:
        try:
            # The trace context lets the metrics collector's transfer-time exemplars name the trace.
            await self._bus.client.publish(self._subjects.kv_transfers(self.worker_id), encode(record),
                                           headers=inject_headers() or None)
        except Exception as error:  # metrics only: the request goes on
            log.debug("could not publish transfer record: %s", error)
