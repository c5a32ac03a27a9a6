"""The KV data plane of a worker whose engine implements `connector.port.KvPort` (the sim):
transport, holder, lease client and puller wired together behind `connector.dataplane.DataPlane`.

The worker service calls `prepare()` before it starts a request (pull the blocks the
request names, from a P/D handle or a prefix holder), `hold()` when a prefill for a
decode worker finishes (lease its blocks), `release_pins()` when the engine took the
request and when it ends, and the push-mode methods (see `connector.push`). Transfer
records are published on `kv.transfers.<worker>`; counters feed the load snapshot.
Built by the sim engine's spec (`services/worker/sim/spec.py`).
"""

from __future__ import annotations

import time

from opentelemetry import trace

from connector.dataplane import LeasingDataPlane, Prepared
from connector.port import KvPort
from connector.puller import KvPuller
from connector.push import PushReceiver, PushWriter
from connector.push_receipt import PushReceipt
from connector.rank_transports import RankTransports
from connector.sim.holder import KvHolder
from connector.spans import end_transfer_span
from shared.bus import Bus
from shared.codec import MalformedCounter
from shared.config import WorkerConfig
from shared.schemas.generate import GenerateRequest, prompt_chain
from shared.schemas.load import RankTransfers
from shared.schemas.transfer import KvHandle, PushTarget


class WorkerKv(LeasingDataPlane[KvHolder, PushReceiver, PushWriter]):
    def __init__(self, config: WorkerConfig, bus: Bus, port: KvPort, agents: RankTransports, *, compat_hash: str,
                 malformed: MalformedCounter | None = None) -> None:
        settings = config.kv_transfer
        subjects = config.bus.subjects
        self.port = port
        self.agents = agents
        block_size = agents.shape.block_size
        super().__init__(config.worker_id, bus, subjects, KvHolder(
            config.worker_id, bus, subjects, port, agents, compat_hash=compat_hash, block_size=block_size,
            lease_ttl_s=settings.lease_ttl_s, sweep_interval_s=settings.lease_sweep_interval_s, malformed=malformed),
            agents, compat_hash=compat_hash, block_size=block_size, settings=settings)
        self.puller = KvPuller(self.leases, port, agents, transfer_timeout_s=settings.transfer_timeout_s,
                               retry=settings.retry, faults=settings.faults)
        self._faults = settings.faults
        self._transfer_timeout_s = settings.transfer_timeout_s

    @property
    def _block_nbytes(self) -> int:
        return self.agents.shape.model_block_nbytes

    async def stop(self) -> None:
        await super().stop()
        self.agents.close()

    async def prepare(self, request: GenerateRequest) -> Prepared:
        """Pull what the request's `kv_transfer` names; never raises for a failed transfer
        (the engine computes what did not arrive), only for a refused, incompatible handle."""
        params = request.kv_transfer
        source = self.pull_source(params) if params is not None else None
        if params is None or source is None:
            return Prepared()
        kind, holder = source
        span = self._pull_span(kind, holder)
        with trace.use_span(span, end_on_exit=False):
            outcome = None
            try:
                handle = await self._pull_handle(params, holder, span)
                if handle is None:
                    return Prepared()
                outcome = await self.puller.pull(request.request_id, handle, request.token_ids, kind=kind,
                                                 adapter=request.adapter, cache_salt=request.cache_salt)
            finally:
                end_transfer_span(span, outcome.pull.record() if outcome is not None else None)
        try:
            await self._publish(outcome.pull.record())
        except BaseException:  # cancelled: the request never gets the pinned blocks
            self.port.unpin(outcome.pinned_block_ids)
            raise
        prepared = Prepared(pinned_block_ids=outcome.pinned_block_ids)
        outcome.pull.fill(prepared)
        self._count(prepared)
        return prepared

    def hold(self, request: GenerateRequest) -> KvHandle | None:
        """Lease the request's prompt blocks for a decode worker. Call it as soon as the
        prefill's output arrives, before awaiting anything (the blocks could be evicted)."""
        return self.holder.grant("decode", prompt_chain(request, self.block_size))

    # ---- push mode ----------------------------------------------------------------

    async def push_receiver(self, request: GenerateRequest) -> PushReceiver:
        """Decode side: pin one block per full prompt block for the writer (none if the pool
        cannot spare them: then the writer sends nothing and this worker computes all)."""
        count = len(request.token_ids) // self.block_size
        block_ids = (self.port.allocate_for_transfer(count) if count else None) or []
        target = PushTarget(reader_worker_id=self.worker_id, agent_name=self.agents.agent_name,
                            transfer_id=request.request_id, compat_hash=self.compat_hash, block_ids=block_ids)
        return self._expect_push(PushReceiver(self.port, target, self.block_size))

    async def _commit_push(self, request: GenerateRequest, receiver: PushReceiver, receipt: PushReceipt) -> Prepared:
        """Commit into the port's pinned target blocks what verified; they stay pinned for the
        request (`release_pins`)."""
        receiver.commit(receipt, request.token_ids, adapter=request.adapter, cache_salt=request.cache_salt,
                        now=time.monotonic())
        pinned = [block_id for block_id, good in zip(receiver.target.block_ids, receipt.committed_ok or []) if good]
        prepared = Prepared(pinned_block_ids=pinned)
        receipt.fill(prepared)
        return prepared

    def _give_back(self, receiver: PushReceiver) -> None:
        self.port.unpin(receiver.target.block_ids)

    def _push_writer(self, request: GenerateRequest, target: PushTarget) -> PushWriter:
        return PushWriter(request.request_id, self.port, self.agents, target, timeout_s=self._transfer_timeout_s,
                          faults=self._faults)

    def rank_transfers(self) -> list[RankTransfers]:
        """Each rank's transport counters, read in this process (no question to anyone)."""
        return self.agents.rank_transfers()

    def release_pins(self, prepared: Prepared) -> None:
        if prepared.pinned_block_ids:
            self.port.unpin(prepared.pinned_block_ids)
            prepared.pinned_block_ids = []
