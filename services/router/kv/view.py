"""The router's view of where KV blocks live: one pure `ModelKv` per served model, fed from the bus.

Adapter: subscribes to every worker's KV event stream (decoded by `batch_decode`), follows
membership (a worker that joins is indexed in its model's namespace with its block size; one
that leaves or restarts is purged), and asks a worker for a snapshot while its stream is out
of sync (a gap), on a timer until it is. A worker's events go only into its model's index.
The routing state (`flows.routing_state`) asks `model(name)` for a request's namespace (`model_kv.ModelKv`): how much
of a prompt each of that model's workers holds (`prompt_cache()`), the blocks to pull from
a holder (`prefix_source()`), and each routing recorded as a prediction (`predict()`).
"""

from __future__ import annotations

import asyncio
import logging

from nats.aio.msg import Msg

from services.router.kv.batch_decode import KvBatchDecoder
from services.router.kv.index import IndexStats
from services.router.kv.model_kv import ModelKv, PrefixSource, PromptCache
from services.router.routing.by_model import ByModel
from shared.bus import Bus
from shared.codec import MalformedCounter, encode
from shared.schemas import KvSnapshotRequest
from shared.subjects import Subjects

__all__ = ["KvView", "ModelKv", "PrefixSource", "PromptCache"]

log = logging.getLogger(__name__)


class KvView:
    def __init__(self, bus: Bus, subjects: Subjects, malformed: MalformedCounter, *,
                 resync_interval_s: float = 1.0, verify_hashes: bool = False, tier_aware: bool = True) -> None:
        self._bus = bus
        self._subjects = subjects
        self._batches = KvBatchDecoder(malformed, verify_hashes=verify_hashes)  # token ids only where read
        self._resync_interval_s = resync_interval_s
        self._verify_hashes = verify_hashes
        self._tier_aware = tier_aware
        self._models: ByModel[ModelKv] = ByModel(
            lambda: ModelKv(verify_hashes=self._verify_hashes, tier_aware=self._tier_aware))
        self._subscription = None
        self._resync_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._subscription = await self._bus.client.subscribe(self._subjects.kv_events_all, cb=self._on_batch)
        self._resync_task = asyncio.create_task(self._resync_forever(), name="kv-view-resync")

    async def stop(self) -> None:
        if self._resync_task is not None:
            self._resync_task.cancel()
            await asyncio.gather(self._resync_task, return_exceptions=True)
        if self._subscription is not None:
            try:
                await self._subscription.unsubscribe()
            except Exception:  # connection already closed: nothing left to release
                pass

    # ---- namespaces ------------------------------------------------------------------------

    def model(self, model: str) -> ModelKv:
        """`model`'s namespace (empty until its workers join)."""
        return self._models.part(model)

    def of_worker(self, worker_id: str) -> ModelKv | None:
        """The namespace indexing `worker_id`; None for a worker not (or no longer) a member."""
        return self._models.of_worker(worker_id)

    def stats(self) -> IndexStats:
        """Every namespace's index together (a worker is in one namespace only)."""
        parts = [namespace.index.stats() for namespace in self._models.parts.values()]
        return IndexStats(workers=tuple(worker for part in parts for worker in part.workers),
                          total_blocks=sum(part.total_blocks for part in parts))

    # ---- membership (called by the worker pool) -----------------------------------------

    def worker_joined(self, worker_id: str, block_size: int, kv_tokens: int = 0, *, model: str,
                      lends_host_tier: bool = False) -> None:
        """`kv_tokens`, its KV pool, is the placement's business (`routing.placement.Placements`);
        `lends_host_tier`: a prefix pull may read its host tier (`model_kv.tiered_prefix`)."""
        self._models.join(worker_id, model).worker_joined(worker_id, block_size, lends_host_tier=lends_host_tier)

    def worker_left(self, worker_id: str) -> None:
        self._models.leave(worker_id)

    # ---- events ---------------------------------------------------------------------------

    async def _on_batch(self, msg: Msg) -> None:
        batch = self._batches.decode_or_none(msg.data, msg.subject)
        if batch is None:
            return
        namespace = self.of_worker(batch.worker_id)
        if namespace is None:
            return  # not a member: as the index ignores a worker it does not know
        result = namespace.index.ingest(batch)
        if result.mismatched_blocks:  # only in verification mode: a worker hashes differently
            log.warning("%d block(s) from %s carry a chain hash their token ids refute",
                        result.mismatched_blocks, batch.worker_id)
        if result.resync_needed:
            await self._ask_snapshot(batch.worker_id)

    async def _ask_snapshot(self, worker_id: str) -> None:
        log.info("KV events of %s are out of sync: asking for a snapshot", worker_id)
        try:
            await self._bus.client.publish(self._subjects.control(worker_id, "kv_snapshot"), encode(KvSnapshotRequest()))
        except Exception as error:  # NATS trouble: the resync timer asks again
            log.debug("snapshot request to %s failed: %s", worker_id, error)

    async def _resync_forever(self) -> None:
        while True:
            await asyncio.sleep(self._resync_interval_s)
            for namespace in list(self._models.parts.values()):
                for worker_id in namespace.index.unsynced_workers():
                    await self._ask_snapshot(worker_id)
