"""Push mode between vLLM workers, the Tandem worker's half (runs on the worker's loop).
The same protocol as the sim's (`connector.push`): the reader announces a `PushTarget`,
the writer fills it layer by layer and sends `PushDone` (first token, one checksum per
block); the reader verifies, keeps what verified and computes the rest.

Reader (`VllmPushReceiver`): vLLM's scheduler side pins one fresh block per prompt block,
the partial last one too (`kv_link.allocate`: a control request, no scheduled request waits
meanwhile). When `PushDone` arrives the blocks are checksummed in the model worker and
compared with the writer's; the leading verified full blocks are cached in vLLM under the
prompt's block hashes (`kv_link.commit`) and stay pinned until the request (prompt + first
token), added next, was admitted: it finds them in the prefix cache, has a verified partial
last block copied into its own (`TailOrder`, `push_tail`), and computes only the rest
(vLLM's computed prefix has no holes: from the first failed block on, everything is
computed). A prompt's images go with the commit, so that the blocks are hashed as the
request's own (`image_hashes`).

Writer (`VllmPushWriter`): the push is staged with the engine as part of the request's
`TransferOrder`; vLLM's connector writes each layer of each completed prompt block from
its per-layer save hook (the partial last one, where targeted, at the prompt's last step),
the reused blocks whole at that step, and reports
`Pushed` (per-block outcome, checksums, per-layer timings) before the first token leaves
the engine. `finish()` turns that into `PushDone` and logs the per-layer timings.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

from connector.prepared import Prepared
from connector.push import LayerWrite, PushArrival
from connector.push_ledger import abort_push, end_push, start_push
from connector.push_receipt import PushReceipt
from connector.vllm.engine_port import VllmKvEngine
from connector.vllm.kv_wire import ImagePlace, LayerWritten, Pushed, PushOrder, TailOrder, TransferOrder
from shared.schemas.generate import GenerateRequest
from shared.schemas.transfer import PushDone, PushTarget

log = logging.getLogger(__name__)


def overlapped_layers(writes: list[LayerWritten]) -> list[int]:
    """Layers k whose write started before layer k+1 of the same step was computed, so
    it was in flight while layer k+1 was (layer k+1's compute ends at its `computed_s`)."""
    layered = sorted((w for w in writes if w.layer >= 0), key=lambda w: w.computed_s)
    found = []
    for index, write in enumerate(layered):
        following = next((w for w in layered[index + 1:] if w.layer == write.layer + 1), None)
        if following is not None and write.started_s < following.computed_s:
            found.append(write.layer)
    return found


def describe_writes(writes: list[LayerWritten]) -> str:
    """One line: per write, layer (W: whole blocks), blocks, computed / written ms."""
    return " ".join(f"{'W' if w.layer < 0 else w.layer}:{w.blocks}b@{w.computed_s * 1e3:.1f}"
                    f"/{w.started_s * 1e3:.1f}-{w.done_s * 1e3:.1f}{'' if w.ok else '!'}" for w in writes)


class VllmPushReceiver(PushArrival):
    def __init__(self, target: PushTarget, key: str) -> None:
        super().__init__(target)
        self.key = key  # the pin of the target blocks in vLLM


class VllmPushWriter:
    """What the worker's request runner drives (the sim writer's interface)."""

    def __init__(self, request_id: str, target: PushTarget, engine: VllmKvEngine) -> None:
        self.request_id = request_id
        self.target = target
        self._engine = engine
        self._waiter: asyncio.Future[Pushed] | None = None
        self.timings: list[LayerWrite] = []
        self.writes: list[LayerWritten] = []
        self.on_layer = None  # vLLM's connector writes from its own per-layer hook
        self._span = start_push(target)

    def stage(self, agent_metadata: bytes) -> None:
        order = TransferOrder(transfer_id=self.target.transfer_id, push=PushOrder(
            agent_name=self.target.agent_name, agent_metadata=agent_metadata, block_ids=self.target.block_ids))
        self._engine.stage(self.request_id, order)
        self._waiter = self._engine.kv_link.pushes.expect(self.target.transfer_id)

    def send_reused(self, prompt_hashes: list[int], num_layers: int) -> None:
        return  # the connector writes the reused blocks itself, at the prompt's last step

    async def finish(self, first_token: int | None) -> PushDone:
        count = len(self.target.block_ids)
        report = None
        if self._waiter is not None:
            report = await self._engine.kv_link.pushes.wait(self.target.transfer_id, self._waiter)
            self._waiter = None
        if report is None:
            heads = self._engine.kv_link.shape.num_kv_heads
            failed, checksums, reason = list(range(count)), [0] * (count * heads), "no push report"
        else:
            failed = [index for index, ok in enumerate(report.ok) if not ok]
            checksums, reason = report.checksums, report.reason
            self.writes = report.writes
            self.timings = [LayerWrite(layer=None if w.layer < 0 else w.layer, blocks=w.blocks, queued_s=w.computed_s,
                                       done_s=w.done_s, ok=w.ok) for w in report.writes]
            log.info("push %s to %s: %d of %d block(s) written, %d byte(s); layers written while a later layer "
                     "was computed: %s; writes (layer:blocks@computed/started-done ms): %s",
                     self.target.transfer_id, self.target.reader_worker_id, count - len(failed), count,
                     report.nbytes, overlapped_layers(report.writes), describe_writes(report.writes))
        return end_push(self._span, self.target.transfer_id, first_token, checksums, failed, writes=len(self.writes),
                        nbytes=report.nbytes if report is not None else 0, reason=reason)

    def abort(self) -> None:
        self._engine.kv_link.pushes.forget(self.target.transfer_id)
        self._engine.unstage(self.request_id)  # generate() never took it, if it did not run
        abort_push(self._span)


class VllmPush:
    def __init__(self, worker_id: str, engine: VllmKvEngine, *, block_size: int, compat_hash: str) -> None:
        self.worker_id = worker_id
        self.engine = engine
        self.block_size = block_size
        self.compat_hash = compat_hash
        self._writers: dict[str, VllmPushWriter] = {}  # transfer id -> writer, until staged
        self._keys = itertools.count(1)

    # ---- reader (its wait: `connector.dataplane.LeasingDataPlane.await_push`) ---------------

    async def receiver(self, request: GenerateRequest) -> VllmPushReceiver:
        link = self.engine.kv_link
        count = -(-len(request.token_ids) // self.block_size)  # the partial last block too
        key = f"{request.request_id}#push{next(self._keys)}"
        block_ids = await link.allocate(key, count) if count else []
        target = PushTarget(reader_worker_id=self.worker_id, agent_name=link.agent_name,
                            transfer_id=request.request_id, compat_hash=self.compat_hash, block_ids=block_ids)
        return VllmPushReceiver(target, key)

    def give_back(self, receiver: VllmPushReceiver) -> None:
        self.engine.kv_link.unpin_soon([receiver.key])

    async def commit(self, request: GenerateRequest, receiver: VllmPushReceiver, receipt: PushReceipt) -> Prepared:
        """Cache the leading verified full blocks in vLLM, pinned until the request is
        admitted; a partial last block that verified after all of them stays pinned, and the
        request copies it (`TailOrder`)."""
        link = self.engine.kv_link
        targets = receiver.target.block_ids
        full, tail_tokens = divmod(len(request.token_ids), self.block_size)
        try:
            ours = await link.block_checksums(targets) if any(receipt.landed) else []
            ok = receipt.verify(ours)
            verified = ok.index(False) if False in ok else len(ok)
            keep_tail = tail_tokens > 0 and len(targets) > full and verified > full
            images = [ImagePlace(*image.span) for image in request.images]
            cached = await link.commit(receiver.key, min(verified, full), request.token_ids, images,
                                       request.cache_salt, keep_next=keep_tail) if targets else []
        except BaseException:
            link.unpin_soon([receiver.key])
            raise
        receipt.committed([index < len(cached) for index in range(len(targets))], time.monotonic())
        prepared = Prepared()
        receipt.fill(prepared)
        if cached:  # pinned until the request is admitted (the engine unpins)
            tail = TailOrder(block_id=targets[full], tokens=tail_tokens) if keep_tail and len(cached) > full else None
            self.engine.stage(request.request_id, TransferOrder(transfer_id=request.request_id,
                                                                release_key=receiver.key, tail=tail))
            prepared.staged_request_id = request.request_id
        return prepared

    # ---- writer ---------------------------------------------------------------------------

    def writer(self, request: GenerateRequest, target: PushTarget) -> VllmPushWriter:
        writer = VllmPushWriter(request.request_id, target, self.engine)
        self._writers[target.transfer_id] = writer
        return writer

    def take_writer(self, transfer_id: str) -> VllmPushWriter | None:
        return self._writers.pop(transfer_id, None)
