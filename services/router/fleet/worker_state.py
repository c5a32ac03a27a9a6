"""One worker as this router keeps it: the requests routed to it and what the policy sees of it.
Synchronous, no clock; its only I/O is aborting a request's stream. The worker pool
(`worker_pool`, the NATS adapter) feeds it.

- `InFlight`: one request routed to one worker, counted in that worker's ledger until
  `end()`, with the stream to abort if the worker leaves meanwhile; it reports its steps
  to the pool that began it (`WorkerPool.begin`);
- `WorkerState`: a member's registration and last load snapshot on top of its
  predicted-load ledger (`services.router.routing.ledger.WorkerLoad`), and the
  `WorkerView` the policy reads of them;
- `kv_pool_tokens`, `transfer_group`, `free_kv_tokens`: the figures a registration and a
  load snapshot give the view (and the membership listeners: `WorkerPool._on_member`).
"""

from __future__ import annotations

from typing import Protocol

from services.router.fleet.shared_load import NO_REMOTE_LOAD, RemoteLoad
from services.router.routing.ledger import Ticket, WorkerLoad
from services.router.routing.view import WorkerView
from shared.errors import TandemError
from shared.request_plane import ResponseStream
from shared.schemas import LoadSnapshot, WorkerRegistration

NO_KV_TRANSFER_MARK = ":no-kv-transfer:"  # a transfer group's suffix for a worker without a data plane


class _Pool(Protocol):
    """What an `InFlight` tells the pool that began it (`WorkerPool`)."""

    def _prefill_done(self, in_flight: InFlight) -> None: ...

    def _end(self, in_flight: InFlight) -> None: ...


class InFlight(Ticket):
    """One request routed to one worker, counted in that worker's ledger until `end()`, with
    the stream to abort if the worker leaves meanwhile."""

    def __init__(self, pool: _Pool, worker_id: str, request_id: str, prefill_tokens: int = 0, *,
                 decodes: bool = True) -> None:
        super().__init__(worker_id, request_id, prefill_tokens, decodes=decodes)
        self._pool = pool
        self.stream: ResponseStream | None = None
        self.lost: TandemError | None = None  # set when the worker left while we were routed to it

    def attach(self, stream: ResponseStream) -> None:
        """The request's stream is open; it is aborted at once if the worker already left."""
        self.stream = stream
        if self.lost is not None:
            stream.abort(self.lost)

    def abort(self, error: TandemError) -> None:
        if self.lost is None:
            self.lost = error
            if self.stream is not None:
                self.stream.abort(error)

    def prefill_done(self) -> None:
        """The worker produced its first token: its prompt no longer waits for prefill."""
        if self.prefill_tokens:
            self._pool._prefill_done(self)

    def end(self) -> None:
        self._pool._end(self)


class WorkerState(WorkerLoad[InFlight]):
    """A member: its registration and last load snapshot, on top of its predicted-load ledger
    (a snapshot's arrival is the ledger's `reported()`: it records the counts it covers)."""

    def __init__(self, registration: WorkerRegistration) -> None:
        super().__init__()
        self.registration = registration
        self.load: LoadSnapshot | None = None
        self.remote_at_report = NO_REMOTE_LOAD  # the other routers' share when the last snapshot arrived

    def view(self, remote: RemoteLoad = NO_REMOTE_LOAD) -> WorkerView:
        """`remote`: the other routers' requests on the worker, counted like ours."""
        registration, load, at_report = self.registration, self.load, self.remote_at_report
        return WorkerView(
            worker_id=registration.worker_id,
            model=registration.model,
            role=registration.role,
            status=registration.status,
            max_num_seqs=registration.capacity.max_num_seqs,
            max_model_len=registration.capacity.max_model_len,
            reported_load=None if load is None else load.running + load.waiting,
            in_flight=len(self.in_flight) + remote.in_flight,
            in_flight_at_report=self.in_flight_at_report + at_report.in_flight,
            prefill_parts=self.prefill_parts,
            last_routed=self.last_routed,
            compat_hash=transfer_group(registration),
            reported_prefill_tokens=None if load is None else load.pending_prefill_tokens,
            outstanding_prefill_tokens=self.outstanding_prefill_tokens + remote.prefill_tokens,
            outstanding_prefill_at_report=self.outstanding_prefill_at_report + at_report.prefill_tokens,
            kv_push=registration.capabilities.kv_push,
            kv_capacity_tokens=kv_pool_tokens(registration),
            reported_free_kv_tokens=None if load is None else free_kv_tokens(load, registration.block_size),
            adapters=frozenset(registration.adapters),
            adapter_slots=registration.adapter_slots,
            block_size=registration.block_size,
            kv_layout=registration.kv_layout,
        )

    def abort_all(self, error: TandemError) -> None:
        for in_flight in list(self.in_flight.values()):
            in_flight.abort(error)


def kv_pool_tokens(registration: WorkerRegistration) -> int:
    """The tokens the worker's KV pool holds."""
    return registration.capacity.kv_blocks * registration.block_size


def transfer_group(registration: WorkerRegistration) -> str:
    """Workers exchange KV blocks only within a group: equal compatibility hashes, and a
    data plane. A worker without one is a group of its own, so it is never paired and never
    named as a holder to pull from (it would have to refuse)."""
    if registration.kv_transfer:
        return registration.compat_hash
    return f"{registration.compat_hash}{NO_KV_TRANSFER_MARK}{registration.worker_id}"


def free_kv_tokens(load: LoadSnapshot, block_size: int) -> int:
    """KV that holds nothing reusable nor live, in tokens: filling it evicts no cached prefix."""
    return max(0, load.kv_total_blocks - max(load.kv_cached_blocks, load.kv_used_blocks)) * block_size
