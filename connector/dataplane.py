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
holder, counters, and transfer records published on `kv.transfers.<worker>`.
"""

from __future__ import annotations

import logging
from typing import Generic, Protocol, TypeVar

from connector.holder import LeaseHolder
from connector.prepared import Prepared
from connector.push import PushReceiver, PushWriter
from shared.bus import Bus
from shared.codec import encode
from shared.schemas.generate import GenerateRequest
from shared.schemas.load import RankTransfers
from shared.schemas.transfer import KvHandle, PushDone, PushTarget, TransferRecord
from shared.subjects import Subjects
from shared.tracing import inject_headers

log = logging.getLogger(__name__)


class DataPlane(Protocol):
    @property
    def active_leases(self) -> int: ...

    @property
    def pulled_tokens_total(self) -> int: ...

    @property
    def recomputed_tokens_total(self) -> int: ...

    @property
    def blocks_retried_total(self) -> int: ...

    @property
    def blocks_recovered_total(self) -> int: ...

    @property
    def blocks_recomputed_total(self) -> int: ...

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


class LeasingDataPlane(Generic[HolderT]):
    """What every engine's data plane shares: the holder it starts and stops, its lease
    count, the transfer counters of the load snapshot, and transfer records."""

    def __init__(self, worker_id: str, bus: Bus, subjects: Subjects, holder: HolderT) -> None:
        self.worker_id = worker_id
        self._bus = bus
        self._subjects = subjects
        self.holder = holder
        self.pulled_tokens_total = 0
        self.recomputed_tokens_total = 0
        self.blocks_retried_total = 0
        self.blocks_recovered_total = 0
        self.blocks_recomputed_total = 0

    @property
    def active_leases(self) -> int:
        return self.holder.leases.active

    async def start(self) -> None:
        await self.holder.start()

    async def stop(self) -> None:
        await self.holder.stop()

    def release_hold(self, handle: KvHandle) -> None:
        self.holder.release(handle.lease_id, "cancelled")

    def _count(self, prepared: Prepared) -> None:
        self.pulled_tokens_total += prepared.pulled_tokens
        self.recomputed_tokens_total += prepared.recomputed_tokens
        self.blocks_retried_total += prepared.retried_blocks
        self.blocks_recovered_total += prepared.recovered_blocks
        self.blocks_recomputed_total += prepared.recomputed_blocks

    async def _publish(self, record: TransferRecord) -> None:
        try:
            # The trace context lets the metrics collector's transfer-time exemplars name the trace.
            await self._bus.client.publish(self._subjects.kv_transfers(self.worker_id), encode(record),
                                           headers=inject_headers() or None)
        except Exception as error:  # metrics only: the request goes on
            log.debug("could not publish transfer record: %s", error)
