"""Push mode: the prefill worker writes the prompt's KV into blocks the decode worker
allocated, layer by layer as each layer is computed, so the transfer overlaps compute.

Decode side (`PushReceiver`, a `PushArrival` as vLLM's receiver is): allocate and pin one
block per full prompt block, announce them (`PushTarget`, sent to the router in a
`KvTarget` frame), wait (bounded) for the writer's `PushDone` (`wait_for_push`, both
engines), then verify and commit into a `connector.push_receipt.PushReceipt` (both engines:
the outcome and the record).

Prefill side (`PushWriter`): the engine's `on_layer` hook queues a write of layer `l` of
the blocks that step completed; when prefill ends, prompt blocks the engine reused from
its cache (never computed, so never reported) are written whole, every write is awaited,
and `PushDone` carries the first token and one checksum per block to the reader. What was
sent and what failed is a `connector.push_ledger.PushLedger`, the same as vLLM's writer's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec

from connector.faults import write_faults
from connector.port import KvPort
from connector.push_ledger import PushLedger, abort_push, end_push, start_push
from connector.push_receipt import PushReceipt
from connector.range_plan import plan_ranges, write_targets
from connector.rank_transports import RankTransports
from connector.token_map import token_segments
from connector.transport import TransferResult
from shared.config import KvFaultConfig
from shared.errors import Timeout, Unavailable
from shared.schemas.transfer import PushDone, PushTarget

log = logging.getLogger(__name__)


class LayerWrite(msgspec.Struct, kw_only=True):
    """Timing of one write, relative to the writer's start: shows the overlap."""

    layer: int | None  # None: whole blocks (reused from the cache)
    blocks: int
    queued_s: float  # when the layer was final (computed)
    done_s: float
    ok: bool


class PushWriter:
    def __init__(self, request_id: str, port: KvPort, agents: RankTransports, target: PushTarget, *,
                 timeout_s: float, faults: KvFaultConfig = KvFaultConfig()) -> None:
        self.request_id = request_id
        self._port = port
        self._agents = agents
        self.target = target
        self._timeout_s = timeout_s
        self._faults = faults
        self._started = time.monotonic()
        self._writes: list[asyncio.Task[TransferResult]] = []
        self._ledger = PushLedger(len(target.block_ids))  # its sources: set at the end
        self._pinned: list[int] = []
        self.timings: list[LayerWrite] = []
        self._nbytes = 0  # written so far
        self._span = start_push(target)  # one event per write, ended by finish() or abort()

    def on_layer(self, layer: int, block_ids: list[int]) -> None:
        """Engine hook (sync, on the loop): queue the write of this layer of these blocks."""
        positions = {block_id: index for index, block_id in enumerate(self._port.prompt_block_ids(self.request_id))}
        pairs = [(block_id, positions[block_id]) for block_id in block_ids
                 if positions.get(block_id, len(self.target.block_ids)) < len(self.target.block_ids)]
        if not pairs:
            return
        if layer == 0:  # keep the source blocks ours until their last layer is written
            self._port.pin_blocks([block_id for block_id, _ in pairs])
            self._pinned += [block_id for block_id, _ in pairs]
        self._ledger.sent([index for _, index in pairs], layer)
        self._queue([block_id for block_id, _ in pairs], [index for _, index in pairs], layer)

    def _queue(self, local: list[int], indices: list[int], layer: int | None) -> None:
        queued = time.monotonic() - self._started

        async def write() -> TransferResult:
            result = await self._write(local, indices, layer)
            timing = LayerWrite(layer=layer, blocks=len(local), queued_s=queued,
                                done_s=time.monotonic() - self._started, ok=result.outcome == "done")
            self.timings.append(timing)
            self._nbytes += result.nbytes
            self._span.add_event("kv.push.write", {
                "tandem.kv.layer": -1 if layer is None else layer, "tandem.kv.blocks": timing.blocks,
                "tandem.kv.bytes": result.nbytes, "tandem.kv.queued_s": timing.queued_s,
                "tandem.kv.done_s": timing.done_s, "tandem.kv.ok": timing.ok})
            self._ledger.fail(index for index, ok in zip(indices, result.ok) if not ok)
            return result

        self._writes.append(asyncio.ensure_future(write()))

    async def _write(self, local: list[int], indices: list[int], layer: int | None) -> TransferResult:
        """Write one layer (or all) of `local` into the target blocks at `indices`: each local
        rank the parts of the reader's ranks it is the source of (`range_plan.write_targets`).
        Injected faults skip some blocks, reported failed or (corrupt) not."""
        reader = self._agents.peer_of(self.target.agent_name)
        if reader is None:
            return TransferResult(outcome="failed", ok=[False] * len(local), reason="the reader's agent is unknown")
        faults = write_faults(self._faults, [self.target.block_ids[index] for index in indices])
        written = faults.written
        size = self._agents.shape.block_size
        segments = token_segments([local[i] for i in written], size,
                                  [self.target.block_ids[indices[i]] for i in written], size, len(written) * size)
        layers = None if layer is None else range(layer, layer + 1)
        writes = []
        for rank in self._agents.local_ranks:
            for part in write_targets(rank.geometry, self._agents.shape, reader.shape):
                plan = plan_ranges(part, segments, layers=layers)
                if len(plan):
                    writes.append(rank.mover.write_ranges(reader.rank_agents[part.dst.rank], plan.dst_offsets,
                                                          plan.src_offsets, plan.lengths, timeout_s=self._timeout_s))
        results = await asyncio.gather(*writes)
        done = all(result.outcome == "done" for result in results)
        failed = set(faults.failed)
        return TransferResult(outcome="done" if done else "failed", nbytes=sum(result.nbytes for result in results),
                              ok=[done and position not in failed for position in range(len(local))],
                              reason=next((result.reason for result in results if result.reason), ""))

    def send_reused(self, prompt_hashes: list[int], num_layers: int) -> None:
        """Call at the prefill's final output, before any await: write, whole, every prompt
        block the engine did not compute (reused from its cache)."""
        pinned = self._port.pin_prefix(prompt_hashes[: len(self.target.block_ids)])
        self._pinned += pinned
        self._ledger.source(range(len(pinned)), pinned)
        missing = self._ledger.unsent(num_layers)
        if missing:
            self._queue([pinned[index] for index in missing], missing, None)

    async def finish(self, first_token: int | None) -> PushDone:
        """Wait for every write, then describe the outcome for the reader."""
        results = await asyncio.gather(*self._writes, return_exceptions=True)
        if any(isinstance(result, BaseException) for result in results):
            log.warning("%s: a push write raised: %s", self.request_id, results)
            self._ledger.fail_all()
        checksums = self._ledger.checksums(self._port.block_checksums, self._agents.shape.num_kv_heads)
        self.release()
        return end_push(self._span, self.target.transfer_id, first_token, checksums, self._ledger.failed_blocks(),
                        writes=len(self.timings), nbytes=self._nbytes)

    def release(self) -> None:
        if self._pinned:
            self._port.unpin(self._pinned)
            self._pinned = []

    def abort(self) -> None:
        for write in self._writes:
            write.cancel()
        self.release()
        abort_push(self._span)


async def wait_for_push(done: asyncio.Future[PushDone], wait_s: float, give_back: Callable[[], None]) -> PushDone:
    """The reader's wait, for both engines: the writer's `PushDone` with a first token, within
    `wait_s`. Otherwise the target blocks are given back (`give_back`) and the wait ends in
    Timeout, Unavailable (the writer failed) or the caller's cancellation."""
    try:
        message = await asyncio.wait_for(asyncio.shield(done), wait_s)
    except asyncio.TimeoutError:
        give_back()
        raise Timeout(f"no push from the prefill worker within {wait_s:g}s") from None
    except BaseException:
        give_back()
        raise
    if message.first_token is None:
        give_back()
        raise Unavailable(f"the prefill worker failed: {message.outcome}")
    return message


class PushArrival:
    """Decode side of one push, for both engines: the target announced to the writer, and
    the wait for its `PushDone` (`connector.dataplane.LeasingDataPlane.await_push`)."""

    def __init__(self, target: PushTarget) -> None:
        self.target = target
        self.done: asyncio.Future[PushDone] = asyncio.get_running_loop().create_future()
        self.claimed = False  # await_push took it (else it expires, its blocks given back)

    def deliver(self, message: PushDone) -> None:
        if not self.done.done():
            self.done.set_result(message)


class PushReceiver(PushArrival):
    """A push into an in-process `KvPort`'s pinned target blocks."""

    def __init__(self, port: KvPort, target: PushTarget, block_size: int) -> None:
        super().__init__(target)
        self._port = port
        self.block_size = block_size

    def commit(self, receipt: PushReceipt, token_ids: list[int], *, adapter: str = "", cache_salt: str = "",
               now: float) -> None:
        """Verify and commit what arrived (into `receipt`); unpins what did not commit."""
        targets = self.target.block_ids
        ours = self._port.block_checksums(targets) if targets else []
        receipt.committed(self._port.commit_transferred(targets, 0, token_ids, receipt.verify(ours), adapter=adapter,
                                                        cache_salt=cache_salt),
                          now)
        self._port.unpin([block_id for block_id, good in zip(targets, receipt.committed_ok or []) if not good])
