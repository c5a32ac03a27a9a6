"""The metrics collector's cluster view: pure state fed by the event streams.

Only members are tracked: a worker enters with `apply_registration` (its bucket entry)
and leaves with `remove_worker`; load and KV messages from anyone else are counted and
dropped, so a message arriving after a worker left cannot resurrect it.

KV events are tracked per worker by engine block hash, with the stream's sequence
number (`shared.cluster.sequence`): `apply_kv` returns True when the caller must ask the
worker for a snapshot (each batch out of order: a gap, a restarted stream, or first
contact in the middle of a stream). The snapshot arrives as `AllBlocksCleared` +
`BlockStored` on the normal stream and resets the count.

Request records, transfer records and departures also feed the view's `RecentActivity`
(`services.metrics.activity`) when the caller passes `now`: rates over a sliding window,
the last routing decisions, recent errors, workers gone lately. `status(now)` is what the
collector serves as `/cluster` (the live cluster page and `tandem status` read it): the
snapshot plus workers grouped by role and that activity.

Everything is synchronous and clock-free; `snapshot()` and `status(now)` return msgspec
Structs that encode directly to JSON.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import msgspec

from services.metrics.activity import ActivitySummary, RecentActivity
from shared.cluster.member_events import MemberChange, member_change
from shared.cluster.sequence import SequenceTracker, SyncState
from shared.compat import KvLayout
from shared.schemas import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    LoadSnapshot,
    RequestRecord,
    TransferRecord,
    WorkerRegistration,
    WorkerRole,
    WorkerStatus,
)
from shared.schemas.kv_events import BlockStoredWithoutTokens, KvEventBatchWithoutTokens
from shared.schemas.load import RankTransfers


class WorkerView(msgspec.Struct, kw_only=True):
    worker_id: str
    role: str
    status: str
    model: str
    # from the latest LoadSnapshot (zero until the first one)
    load_seq: int | None
    running: int
    waiting: int
    kv_total_blocks: int
    kv_used_blocks: int
    kv_cached_blocks: int
    kv_usage: float  # used / total blocks
    pending_prefill_tokens: int
    prompt_tokens_total: int
    cached_tokens_total: int
    generated_tokens_total: int
    prefix_hit_rate: float | None  # cached / prompt tokens since the worker started
    # from the KV event stream
    kv_seq: int | None
    kv_stored_blocks: int
    kv_synced: bool  # False from a gap until the snapshot's AllBlocksCleared arrives
    kv_gaps: int
    # KV hand-offs (from the load snapshot)
    active_leases: int = 0
    kv_pulled_tokens_total: int = 0
    kv_recomputed_tokens_total: int = 0
    kv_blocks_retried_total: int = 0
    kv_blocks_recovered_total: int = 0
    kv_blocks_recomputed_total: int = 0
    computed_prompt_tokens_total: int = 0
    external_prompt_tokens_total: int = 0
    kv_evicted_blocks_total: int = 0
    kv_evicted_missed_blocks_total: int = 0
    kv_ranks: list[RankTransfers] = []  # each KV rank's transfer counters, by rank
    # from the registration, for people (decisions use capabilities and the hash)
    engine: str = ""
    shape: str = ""  # how its KV is cut, "tp2 pp1 bs16" (`shape_label`); "" when it did not say
    compat_hash: str = ""  # equal hashes can exchange KV blocks
    started_at: float = 0.0
    restarts: int = 0  # times its launcher started it again
    last_exit: str = ""  # how its previous process ended


class Totals(msgspec.Struct, kw_only=True):
    workers: int
    running: int
    waiting: int
    kv_total_blocks: int
    kv_used_blocks: int
    kv_usage: float
    kv_stored_blocks: int
    pending_prefill_tokens: int
    prompt_tokens_total: int
    cached_tokens_total: int
    prefix_hit_rate: float | None


class RequestTotals(msgspec.Struct, kw_only=True):
    by_outcome: dict[str, int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_mean_s: float | None


class ClusterSnapshot(msgspec.Struct, kw_only=True):
    workers: list[WorkerView]  # sorted by worker id
    totals: Totals
    by_role: dict[str, Totals]
    requests: RequestTotals
    dropped_unknown_worker: int  # load / KV messages from workers not in the bucket


class RoleGroup(msgspec.Struct, kw_only=True):
    role: str
    worker_ids: list[str]  # sorted
    totals: Totals


class ClusterStatus(ClusterSnapshot, kw_only=True):
    """`/cluster`: the snapshot, the workers grouped by role, and the recent activity."""

    now: float  # the collector's wall clock when it answered
    roles: list[RoleGroup]  # prefill, decode, both; then any other role; only roles with workers
    activity: ActivitySummary


@dataclass
class _Worker:
    registration: WorkerRegistration
    load: LoadSnapshot | None = None
    stored: set[int] = field(default_factory=set)  # engine block hashes held now


class ClusterView:
    def __init__(self, activity: RecentActivity | None = None) -> None:
        self.activity = activity or RecentActivity()
        self._workers: dict[str, _Worker] = {}
        self._kv_sequences = SequenceTracker()
        self._outcomes: Counter[str] = Counter()
        self._request_tokens: Counter[str] = Counter()
        self._ttft_sum_s = 0.0
        self._ttft_count = 0
        self.dropped_unknown_worker = 0

    @property
    def worker_ids(self) -> list[str]:
        return sorted(self._workers)

    def apply_registration(self, registration: WorkerRegistration) -> None:
        known = self._workers.get(registration.worker_id)
        if known is not None and member_change(known.registration, registration) is MemberChange.UPDATED:
            known.registration = registration
        else:  # a new process under this id starts with an empty cache and a new stream
            self._workers[registration.worker_id] = _Worker(registration)
            self._kv_sequences.forget(registration.worker_id)
            self.activity.forget_departure(registration.worker_id)

    def remove_worker(self, worker_id: str, now: float | None = None) -> bool:
        """The worker left the bucket; with `now`, it is listed as departed (drained when its
        last registration said draining, lost otherwise: its heartbeat expired)."""
        self._kv_sequences.forget(worker_id)
        worker = self._workers.pop(worker_id, None)
        if worker is not None and now is not None:
            registration = worker.registration
            self.activity.record_departure(worker_id, registration.role.value, now,
                                           drained=registration.status is WorkerStatus.DRAINING)
        return worker is not None

    def apply_load(self, snapshot: LoadSnapshot) -> None:
        worker = self._member(snapshot.worker_id)
        if worker is not None:
            worker.load = snapshot

    def apply_kv(self, batch: KvEventBatch | KvEventBatchWithoutTokens) -> bool:
        """Apply a batch (its token ids are not read); True when the worker must be asked for a KV snapshot."""
        worker = self._member(batch.worker_id)
        if worker is None:
            return False
        for event in batch.events:
            match event:
                case BlockStored(block_hashes=hashes) | BlockStoredWithoutTokens(block_hashes=hashes):
                    worker.stored.update(hashes)
                case BlockRemoved(block_hashes=hashes):
                    worker.stored.difference_update(hashes)
                case AllBlocksCleared():
                    worker.stored.clear()
        # A batch that opens with a clear is a snapshot (or a real clear): what came before is moot.
        snapshot = bool(batch.events) and isinstance(batch.events[0], AllBlocksCleared)
        step = self._kv_sequences.observe(batch.worker_id, batch.seq, resynced=snapshot)
        return step.out_of_order and not step.synced

    def apply_request(self, record: RequestRecord, now: float | None = None) -> None:
        """Count the record in the totals; with `now`, also in the recent activity."""
        if now is not None:
            self.activity.record_request(record, now)
        self._outcomes[record.outcome] += 1
        self._request_tokens["prompt"] += record.prompt_tokens
        self._request_tokens["cached"] += record.cached_tokens
        self._request_tokens["completion"] += record.completion_tokens
        if record.ttft_s is not None:
            self._ttft_sum_s += record.ttft_s
            self._ttft_count += 1

    def apply_transfer(self, record: TransferRecord, now: float) -> None:
        self.activity.record_transfer(record, now)

    def status(self, now: float) -> ClusterStatus:
        snapshot = self.snapshot()
        return ClusterStatus(**msgspec.structs.asdict(snapshot), now=now, roles=role_groups(snapshot),
                             activity=self.activity.summary(now))

    def snapshot(self) -> ClusterSnapshot:
        workers = [_worker_view(self._workers[worker_id], self._kv_sequences) for worker_id in sorted(self._workers)]
        roles = sorted({view.role for view in workers})
        return ClusterSnapshot(
            workers=workers,
            totals=_totals(workers),
            by_role={role: _totals([view for view in workers if view.role == role]) for role in roles},
            requests=RequestTotals(
                by_outcome=dict(sorted(self._outcomes.items())),
                prompt_tokens=self._request_tokens["prompt"],
                cached_tokens=self._request_tokens["cached"],
                completion_tokens=self._request_tokens["completion"],
                ttft_mean_s=self._ttft_sum_s / self._ttft_count if self._ttft_count else None,
            ),
            dropped_unknown_worker=self.dropped_unknown_worker,
        )

    def _member(self, worker_id: str) -> _Worker | None:
        worker = self._workers.get(worker_id)
        if worker is None:
            self.dropped_unknown_worker += 1
        return worker


_ROLE_ORDER = {role.value: index for index, role in enumerate(WorkerRole)}


def role_groups(snapshot: ClusterSnapshot) -> list[RoleGroup]:
    """Workers by role, in the order prefill, decode, both (then any other role by name)."""
    roles = sorted(snapshot.by_role, key=lambda role: (_ROLE_ORDER.get(role, len(_ROLE_ORDER)), role))
    return [RoleGroup(role=role, totals=snapshot.by_role[role],
                      worker_ids=[view.worker_id for view in snapshot.workers if view.role == role])
            for role in roles]


def shape_label(layout: KvLayout | None) -> str:
    """How a worker's KV is cut, for people: "tp2 pp1 bs128" (tensor- and pipeline-parallel
    degree, tokens per block); "" for a registration without a layout."""
    if layout is None:
        return ""
    return f"tp{layout.tensor_parallel} pp{layout.pipeline_parallel} bs{layout.block_size}"


def _ratio(numerator: int, denominator: int) -> float | None:
    return numerator / denominator if denominator else None


# Stands in for a worker's load until its first snapshot arrives.
_NO_LOAD = LoadSnapshot(worker_id="", seq=0, ts=0.0, running=0, waiting=0, kv_total_blocks=0,
                        kv_used_blocks=0, kv_cached_blocks=0, prompt_tokens_total=0,
                        cached_tokens_total=0, generated_tokens_total=0, pending_prefill_tokens=0)


def _worker_view(worker: _Worker, kv_sequences: SequenceTracker) -> WorkerView:
    registration, load = worker.registration, worker.load or _NO_LOAD
    worker_id = registration.worker_id
    return WorkerView(
        worker_id=worker_id,
        role=registration.role.value,
        status=registration.status.value,
        model=registration.model,
        load_seq=worker.load.seq if worker.load else None,
        running=load.running,
        waiting=load.waiting,
        kv_total_blocks=load.kv_total_blocks,
        kv_used_blocks=load.kv_used_blocks,
        kv_cached_blocks=load.kv_cached_blocks,
        kv_usage=_ratio(load.kv_used_blocks, load.kv_total_blocks) or 0.0,
        pending_prefill_tokens=load.pending_prefill_tokens,
        prompt_tokens_total=load.prompt_tokens_total,
        cached_tokens_total=load.cached_tokens_total,
        generated_tokens_total=load.generated_tokens_total,
        prefix_hit_rate=_ratio(load.cached_tokens_total, load.prompt_tokens_total),
        kv_seq=kv_sequences.last_seq(worker_id),
        kv_stored_blocks=len(worker.stored),
        kv_synced=kv_sequences.state(worker_id) is SyncState.SYNCED,
        kv_gaps=kv_sequences.gaps(worker_id),
        active_leases=load.active_leases,
        kv_pulled_tokens_total=load.kv_pulled_tokens_total,
        kv_recomputed_tokens_total=load.kv_recomputed_tokens_total,
        kv_blocks_retried_total=load.kv_blocks_retried_total,
        kv_blocks_recovered_total=load.kv_blocks_recovered_total,
        kv_blocks_recomputed_total=load.kv_blocks_recomputed_total,
        computed_prompt_tokens_total=load.computed_prompt_tokens_total,
        external_prompt_tokens_total=load.external_prompt_tokens_total,
        kv_evicted_blocks_total=load.kv_evicted_blocks_total,
        kv_evicted_missed_blocks_total=load.kv_evicted_missed_blocks_total,
        kv_ranks=load.kv_ranks,
        engine=registration.engine,
        shape=shape_label(registration.kv_layout),
        compat_hash=registration.compat_hash,
        started_at=registration.started_at,
        restarts=registration.restarts,
        last_exit=registration.last_exit,
    )


def _totals(workers: list[WorkerView]) -> Totals:
    kv_total = sum(view.kv_total_blocks for view in workers)
    kv_used = sum(view.kv_used_blocks for view in workers)
    prompt = sum(view.prompt_tokens_total for view in workers)
    cached = sum(view.cached_tokens_total for view in workers)
    return Totals(
        workers=len(workers),
        running=sum(view.running for view in workers),
        waiting=sum(view.waiting for view in workers),
        kv_total_blocks=kv_total,
        kv_used_blocks=kv_used,
        kv_usage=_ratio(kv_used, kv_total) or 0.0,
        kv_stored_blocks=sum(view.kv_stored_blocks for view in workers),
        pending_prefill_tokens=sum(view.pending_prefill_tokens for view in workers),
        prompt_tokens_total=prompt,
        cached_tokens_total=cached,
        prefix_hit_rate=_ratio(cached, prompt),
    )
