"""A worker's two event streams on NATS, each numbered from 1: KV event batches
(`kv.events.<worker>`, split into several messages when a snapshot outgrows NATS's payload
limit) and load snapshots (`load.<worker>`: the engine's load and the data plane's counters,
its KV ranks' transfer counters among them)."""

from __future__ import annotations

import time

from connector.dataplane import DataPlane
from connector.prepared import TransferTotals
from services.worker.engine import Engine
from shared.bus import Bus
from shared.codec import encode
from shared.kv_event_batches import split_events
from shared.schemas import KvEventBatch, LoadSnapshot
from shared.schemas.kv_events import KvEvent, for_wire
from shared.subjects import Subjects

DEFAULT_MAX_PAYLOAD = 1024 * 1024  # a NATS server's default, when the client has not heard one
BATCH_HEADROOM_BYTES = 1024  # the batch's own fields and the message's framing


class WorkerEvents:
    def __init__(self, worker_id: str, bus: Bus, subjects: Subjects, engine: Engine, kv: DataPlane | None) -> None:
        self.worker_id = worker_id
        self._bus = bus
        self._subjects = subjects
        self._engine = engine
        self._kv = kv
        self._kv_seq = 0
        self._load_seq = 0

    async def publish_kv_events(self, events: list[KvEvent] | None = None) -> None:
        """The engine's new KV events (or `events`), as one batch or several."""
        events = self._engine.take_kv_events() if events is None else events
        if not events:
            return
        events = for_wire(events)  # token ids packed
        client = self._bus.client
        subject = self._subjects.kv_events(self.worker_id)
        batch = KvEventBatch(worker_id=self.worker_id, seq=self._kv_seq + 1, ts=time.time(), events=events)
        data = encode(batch)
        budget = (client.max_payload or DEFAULT_MAX_PAYLOAD) - BATCH_HEADROOM_BYTES
        if len(data) <= budget:
            self._kv_seq += 1
            await client.publish(subject, data)
            return
        for part in split_events(events, budget):  # a large snapshot: several messages, numbered on
            self._kv_seq += 1
            await client.publish(subject, encode(KvEventBatch(
                worker_id=self.worker_id, seq=self._kv_seq, ts=batch.ts, events=part)))

    async def publish_load(self) -> None:
        load = self._engine.load()
        kv = self._kv
        totals = kv.totals if kv else TransferTotals()
        self._load_seq += 1
        snapshot = LoadSnapshot(
            worker_id=self.worker_id, seq=self._load_seq, ts=time.time(),
            running=load.running, waiting=load.waiting,
            kv_total_blocks=load.kv_total_blocks, kv_used_blocks=load.kv_used_blocks,
            kv_cached_blocks=load.kv_cached_blocks,
            prompt_tokens_total=load.prompt_tokens_total, cached_tokens_total=load.cached_tokens_total,
            generated_tokens_total=load.generated_tokens_total,
            pending_prefill_tokens=load.pending_prefill_tokens,
            computed_prompt_tokens_total=load.computed_prompt_tokens_total,
            external_prompt_tokens_total=load.external_prompt_tokens_total,
            kv_evicted_blocks_total=load.kv_evicted_blocks_total,
            kv_evicted_missed_blocks_total=load.kv_evicted_missed_blocks_total,
            active_leases=kv.active_leases if kv else 0,
            kv_pulled_tokens_total=totals.pulled_tokens, kv_recomputed_tokens_total=totals.recomputed_tokens,
            kv_blocks_retried_total=totals.retried_blocks, kv_blocks_recovered_total=totals.recovered_blocks,
            kv_blocks_recomputed_total=totals.recomputed_blocks,
            kv_ranks=kv.rank_transfers() if kv else [],
        )
        await self._bus.client.publish(self._subjects.load(self.worker_id), encode(snapshot))
