"""The router's view of where KV blocks live: the pure `KvIndex`, fed from the bus.

Adapter: subscribes to every worker's KV event stream, follows membership (a worker that
joins is indexed with its block size; one that leaves or restarts is purged), and asks a
worker for a snapshot while its stream is out of sync (a gap), on a timer until it is.
The request flows ask `prefix_holder()` which worker holds more of a prompt's prefix than
the worker chosen to compute it, so that worker can pull the prefix instead.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from nats.aio.msg import Msg

from services.router.kv_index import KvIndex, block_hashes_for
from services.router.policy import WorkerView
from shared.bus import Bus
from shared.codec import Codec, MalformedCounter, encode
from shared.schemas import KvEventBatch, KvSnapshotRequest, KvTransferParams, WorkerStatus
from shared.subjects import Subjects

log = logging.getLogger(__name__)


class PrefixSource:
    __slots__ = ("worker_id", "block_hashes")

    def __init__(self, worker_id: str, block_hashes: list[int]) -> None:
        self.worker_id = worker_id
        self.block_hashes = block_hashes

    def as_params(self, **others: object) -> KvTransferParams:
        return KvTransferParams(prefix_holder=self.worker_id, prefix_hashes=self.block_hashes, **others)


class KvView:
    def __init__(self, bus: Bus, subjects: Subjects, malformed: MalformedCounter, *,
                 resync_interval_s: float = 1.0) -> None:
        self._bus = bus
        self._subjects = subjects
        self._batches: Codec[KvEventBatch] = Codec(KvEventBatch, malformed)
        self._resync_interval_s = resync_interval_s
        self.index = KvIndex()
        self._block_sizes: dict[str, int] = {}
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

    # ---- membership (called by the worker pool) -----------------------------------------

    def worker_joined(self, worker_id: str, block_size: int) -> None:
        self._block_sizes[worker_id] = block_size
        self.index.add_worker(worker_id, block_size)

    def worker_left(self, worker_id: str) -> None:
        self._block_sizes.pop(worker_id, None)
        self.index.remove_worker(worker_id)

    # ---- events ---------------------------------------------------------------------------

    async def _on_batch(self, msg: Msg) -> None:
        batch = self._batches.decode_or_none(msg.data, msg.subject)
        if batch is None:
            return
        result = self.index.ingest(batch)
        if result.resync_needed:
            await self._ask_snapshot(batch.worker_id)

    async def _ask_snapshot(self, worker_id: str) -> None:
        log.info("KV events of %s are out of sync: asking for a snapshot", worker_id)
        try:
            await self._bus.client.publish(self._subjects.control(worker_id), encode(KvSnapshotRequest()))
        except Exception as error:  # NATS trouble: the resync timer asks again
            log.debug("snapshot request to %s failed: %s", worker_id, error)

    async def _resync_forever(self) -> None:
        while True:
            await asyncio.sleep(self._resync_interval_s)
            for worker_id in self.index.unsynced_workers():
                await self._ask_snapshot(worker_id)

    # ---- queries (pure, on the request path) -----------------------------------------------

    def prefix_holder(self, prompt_ids: list[int], target: WorkerView,
                      candidates: Iterable[WorkerView]) -> PrefixSource | None:
        """The worker holding the longest prefix of the prompt, if it holds more than `target`
        (same compatibility hash, active); None if `target` already holds the most."""
        block_size = self._block_sizes.get(target.worker_id)
        if block_size is None or len(prompt_ids) < block_size:
            return None
        hashes = block_hashes_for(prompt_ids, block_size)
        overlaps = self.index.match(hashes)
        if not overlaps:
            return None
        own = overlaps.get(target.worker_id, 0)
        best: tuple[int, str] | None = None
        for view in candidates:
            if (view.worker_id == target.worker_id or view.compat_hash != target.compat_hash
                    or view.status is not WorkerStatus.ACTIVE or self._block_sizes.get(view.worker_id) != block_size):
                continue
            held = overlaps.get(view.worker_id, 0)
            if held > own and (best is None or held > best[0]):
                best = (held, view.worker_id)
        if best is None:
            return None
        return PrefixSource(best[1], hashes[: best[0]])
