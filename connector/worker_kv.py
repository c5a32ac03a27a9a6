"""The KV data plane as one worker sees it: transport, holder and puller, wired together.

The worker service calls `prepare()` before it starts a request (pull the blocks the
request names, from a P/D handle or a prefix holder), `hold()` when a prefill for a
decode worker finishes (lease its blocks), and `finish()` when the request ends. Transfer
records are published on `kv.transfers.<worker>`; counters feed the load snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Generic, TypeVar

import msgspec

from connector.faults import FaultInjectingTransport
from connector.holder import KvHolder, LeaseHolder
from connector.memory_transport import MemoryFabric, MemoryTransport
from connector.puller import KvPuller
from connector.push import LayerWrite, PushReceiver, PushWriter
from connector.transport import KvTransport
from services.worker.engine import KvPort
from shared.block_hash import block_hash_chain
from shared.bus import Bus
from shared.codec import MalformedCounter, encode
from shared.config import WorkerConfig
from shared.errors import InvalidArgument, Timeout, Unavailable
from shared.schemas.generate import GenerateRequest
from shared.schemas.transfer import KvHandle, PushDone, PushTarget, TransferRecord

log = logging.getLogger(__name__)

HolderT = TypeVar("HolderT", bound=LeaseHolder)


class Prepared(msgspec.Struct, kw_only=True):
    """What `prepare()` left for the request: pins to drop after its first output, counts."""

    pinned_block_ids: list[int] = []
    pulled_tokens: int = 0
    recomputed_tokens: int = 0


def build_transport(config: WorkerConfig, port: KvPort, *, fabric: MemoryFabric | None = None) -> KvTransport:
    """The transport `config.kv_transfer.transport` names, over the engine's KV region,
    wrapped in fault injection when faults are configured. `fabric`: the memory transport's
    (default: the process's own)."""
    region = port.kv_region()
    settings = config.kv_transfer
    # A fresh agent name per incarnation: readers see the change and re-add the peer.
    name = f"{config.worker_id}-{uuid.uuid4().hex[:8]}"
    transport: KvTransport
    if settings.transport == "memory":
        transport = MemoryTransport(name, region.buffer, region.block_nbytes, region.layer_nbytes, fabric=fabric)
    else:
        from connector.nixl_transport import NixlTransport

        transport = NixlTransport(name, region.buffer, region.block_nbytes, region.layer_nbytes,
                                  progress_delay_us=settings.progress_delay_us,
                                  transfer_timeout_s=settings.transfer_timeout_s)
    if settings.faults.active:
        log.warning("%s: KV fault injection is on: %s", config.worker_id, settings.faults)
        transport = FaultInjectingTransport(transport, settings.faults, region.buffer, region.block_nbytes)
    return transport


class KvDataPlane(Generic[HolderT]):
    """What every engine's data plane shares with `WorkerService`: the holder it starts and
    stops, its lease count and the transfer counters of the load snapshot."""

    def __init__(self, holder: HolderT) -> None:
        self.holder = holder
        self.last_push_timings: list[LayerWrite] = []  # per-layer writes of the last push (overlap)
        self.pulled_tokens_total = 0
        self.recomputed_tokens_total = 0

    @property
    def active_leases(self) -> int:
        return self.holder.leases.active

    async def start(self) -> None:
        await self.holder.start()

    async def stop(self) -> None:
        await self.holder.stop()


class WorkerKv(KvDataPlane[KvHolder]):
    def __init__(self, config: WorkerConfig, bus: Bus, port: KvPort, transport: KvTransport, *, compat_hash: str,
                 malformed: MalformedCounter | None = None) -> None:
        settings = config.kv_transfer
        self.worker_id = config.worker_id
        self.port = port
        self.transport = transport
        self.block_size = port.kv_region().block_size
        self._bus = bus
        self._subjects = config.bus.subjects
        super().__init__(KvHolder(config.worker_id, bus, self._subjects, port, transport, compat_hash=compat_hash,
                                  block_size=self.block_size, lease_ttl_s=settings.lease_ttl_s, malformed=malformed))
        self.puller = KvPuller(config.worker_id, bus, self._subjects, port, transport, compat_hash=compat_hash,
                               block_size=self.block_size, control_timeout_s=settings.control_timeout_s,
                               transfer_timeout_s=settings.transfer_timeout_s, lease_ttl_s=settings.lease_ttl_s)
        self.compat_hash = compat_hash
        self._push_wait_s = settings.push_wait_s
        self._transfer_timeout_s = settings.transfer_timeout_s
        self._receivers: dict[str, PushReceiver] = {}

    async def stop(self) -> None:
        await super().stop()
        self.transport.close()

    async def prepare(self, request: GenerateRequest) -> Prepared:
        """Pull what the request's `kv_transfer` names; never raises for a failed transfer
        (the engine computes what did not arrive), only for a refused, incompatible handle."""
        params = request.kv_transfer
        if params is None:
            return Prepared()
        if params.source is not None:
            outcome = await self.puller.pull(request.request_id, params.source, request.token_ids, kind="pull")
        elif params.prefix_holder and params.prefix_hashes and params.prefix_holder != self.worker_id:
            handle = await self.puller.lease_prefix(params.prefix_holder, params.prefix_hashes)
            if handle is None:
                return Prepared()
            outcome = await self.puller.pull(request.request_id, handle, request.token_ids, kind="prefix_pull")
        else:
            return Prepared()
        if outcome.record is not None:
            await self._publish(outcome.record)
        self.pulled_tokens_total += outcome.pulled_tokens
        self.recomputed_tokens_total += outcome.recomputed_tokens
        return Prepared(pinned_block_ids=outcome.pinned_block_ids, pulled_tokens=outcome.pulled_tokens,
                        recomputed_tokens=outcome.recomputed_tokens)

    def hold(self, request: GenerateRequest) -> KvHandle | None:
        """Lease the request's prompt blocks for a decode worker. Call it as soon as the
        prefill's output arrives, before awaiting anything (the blocks could be evicted)."""
        return self.holder.grant("decode", block_hash_chain(request.token_ids, self.block_size))

    # ---- push mode ----------------------------------------------------------------

    def push_receiver(self, request: GenerateRequest) -> PushReceiver:
        """Decode side: pin one block per full prompt block for the writer (none if the pool
        cannot spare them: then the writer sends nothing and this worker computes all)."""
        count = len(request.token_ids) // self.block_size
        block_ids = (self.port.allocate_for_transfer(count) if count else None) or []
        target = PushTarget(reader_worker_id=self.worker_id, agent_name=self.transport.agent_name,
                            transfer_id=request.request_id, compat_hash=self.compat_hash, block_ids=block_ids)
        receiver = PushReceiver(self.port, target, self.block_size)
        self._receivers[target.transfer_id] = receiver
        return receiver

    def deliver_push(self, message: PushDone) -> None:
        receiver = self._receivers.get(message.transfer_id)
        if receiver is not None:
            receiver.deliver(message)

    async def await_push(self, request: GenerateRequest, receiver: PushReceiver) -> tuple[int, Prepared]:
        """Wait for the writer; commit what verified. Returns the first token (the writer's)."""
        started = time.monotonic()
        try:
            message = await asyncio.wait_for(asyncio.shield(receiver.done), self._push_wait_s)
        except asyncio.TimeoutError:
            self.port.unpin(receiver.target.block_ids)
            raise Timeout(f"no push from the prefill worker within {self._push_wait_s:g}s") from None
        except BaseException:
            self.port.unpin(receiver.target.block_ids)
            raise
        finally:
            self._receivers.pop(receiver.target.transfer_id, None)
        if message.first_token is None:
            self.port.unpin(receiver.target.block_ids)
            raise Unavailable(f"the prefill worker failed: {message.outcome}")
        hashes = block_hash_chain(request.token_ids, self.block_size)
        committed = receiver.commit(message, request.token_ids, hashes)
        ok_blocks = sum(committed)
        record = TransferRecord(worker_id=self.worker_id, request_id=request.request_id, kind="push",
                                peer_worker_id="", outcome="done" if all(committed) else "failed",
                                blocks=len(committed), blocks_ok=ok_blocks,
                                bytes=ok_blocks * self.port.kv_region().block_nbytes,
                                duration_s=time.monotonic() - started, pulled_tokens=ok_blocks * self.block_size,
                                recomputed_tokens=(len(committed) - ok_blocks) * self.block_size)
        await self._publish(record)
        self.pulled_tokens_total += record.pulled_tokens
        self.recomputed_tokens_total += record.recomputed_tokens
        pinned = [block_id for block_id, good in zip(receiver.target.block_ids, committed) if good]
        return message.first_token, Prepared(pinned_block_ids=pinned, pulled_tokens=record.pulled_tokens,
                                             recomputed_tokens=record.recomputed_tokens)

    def push_writer(self, request: GenerateRequest, target: PushTarget) -> PushWriter:
        if target.compat_hash != self.compat_hash:
            raise InvalidArgument(f"KV layout mismatch: the reader {target.reader_worker_id} has compatibility "
                                  f"hash {target.compat_hash}, {self.worker_id} has {self.compat_hash}")
        return PushWriter(request.request_id, self.port, self.transport, target,
                          timeout_s=self._transfer_timeout_s)

    async def ensure_push_peer(self, target: PushTarget) -> bool:
        return await self.puller.ensure_agent(target.reader_worker_id, target.agent_name)

    async def send_push_done(self, target: PushTarget, message: PushDone) -> None:
        await self._bus.client.publish(self._subjects.control(target.reader_worker_id), encode(message))

    def release_pins(self, prepared: Prepared) -> None:
        if prepared.pinned_block_ids:
            self.port.unpin(prepared.pinned_block_ids)
            prepared.pinned_block_ids = []

    async def _publish(self, record: TransferRecord) -> None:
        try:
            await self._bus.client.publish(self._subjects.kv_transfers(self.worker_id), encode(record))
        except Exception as error:  # metrics only: the request goes on
            log.debug("could not publish transfer record: %s", error)
