"""The KV data plane of a worker serving a vLLM engine: what `connector.sim.worker_kv.WorkerKv`
is for the sim engine, the same `connector.dataplane.DataPlane` for `WorkerService` and the
same wire protocol (the shared `connector.lease_client.LeaseClient`), so routers and other
workers cannot tell the difference. Built by the vLLM engine's spec
(`services/worker/vllm/spec.py`) over the engine's `engine_port.VllmKvEngine`.

The difference is where blocks move: inside vLLM. A pull is the same `connector.pull.Pull`
as the sim's, driven in another order. `prepare()` does the NATS half (compatibility check,
the holder's agent metadata, a prefix lease) and stages a `TransferOrder` with the engine;
the engine's connector reads the blocks in the request's first step, vLLM keeps those before
the first failed one and computes the rest. The pull's `Loaded` report comes back before
the request's first output (`_on_loaded`): the pull's counts are known, then the lease is
released with its outcome (after the commit: an expired lease marks the record, the
verified blocks stay) and the record published. A hold is vLLM's pin adopted by a lease
(`hold()`).

Push mode (`connector.vllm.push`): the reader's blocks are allocated and, once verified,
cached in vLLM by control requests; the writer's connector writes each layer of the
prompt's blocks from vLLM's per-layer save hook.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from functools import partial

from opentelemetry import trace

from connector.block_io import VerifiedRead
from connector.dataplane import LeasingDataPlane, Prepared
from connector.pull import Pull
from connector.push_receipt import PushReceipt
from connector.spans import end_transfer_span
from connector.vllm.engine_port import VllmKvEngine
from connector.vllm.holder import VllmKvHolder
from connector.vllm.kv_wire import Loaded, PullOrder, TransferOrder
from connector.vllm.push import VllmPush, VllmPushReceiver, VllmPushWriter
from shared.bus import Bus
from shared.codec import MalformedCounter
from shared.config import WorkerConfig
from shared.schemas.generate import GenerateRequest, prompt_chain
from shared.schemas.load import RankTransfers
from shared.schemas.transfer import KvHandle, PushTarget, TransferKind

log = logging.getLogger(__name__)


class PeerAgents:
    """The lease client's `PeerRegistry` here: which holders' agent metadata is known. The
    metadata travels with each pull order to the engine, whose agent adds the peer once."""

    def __init__(self) -> None:
        self._metadata: dict[str, bytes] = {}

    def has_peer(self, name: str) -> bool:
        return name in self._metadata

    def add_peer(self, name: str, metadata: bytes) -> None:
        self._metadata[name] = metadata

    def metadata_of(self, name: str) -> bytes | None:
        return self._metadata.get(name)


class VllmWorkerKv(LeasingDataPlane[VllmKvHolder, VllmPushReceiver, VllmPushWriter]):
    def __init__(self, config: WorkerConfig, bus: Bus, engine: VllmKvEngine, *, block_size: int, compat_hash: str,
                 malformed: MalformedCounter | None = None) -> None:
        settings = config.kv_transfer
        subjects = config.bus.subjects
        self.engine = engine
        self.peers = PeerAgents()
        super().__init__(config.worker_id, bus, subjects, VllmKvHolder(
            config.worker_id, bus, subjects, engine, compat_hash=compat_hash, block_size=block_size,
            lease_ttl_s=settings.lease_ttl_s, malformed=malformed), self.peers, compat_hash=compat_hash,
            block_size=block_size, settings=settings)
        self._hold_keys = itertools.count(1)
        self._tasks: set[asyncio.Task] = set()
        self._push = VllmPush(config.worker_id, engine, block_size=block_size, compat_hash=compat_hash)

    async def stop(self) -> None:
        await super().stop()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---- pull and hold ------------------------------------------------------------------

    async def prepare(self, request: GenerateRequest) -> Prepared:
        """Stage what the request's `kv_transfer` asks of the engine; never raises for a failed
        transfer (vLLM computes what did not arrive), only for a refused, incompatible handle."""
        params = request.kv_transfer
        prepared = Prepared()
        if params is None:
            return prepared
        source = self.pull_source(params)
        handle = params.source
        staged = None
        if source is not None:
            kind, holder = source
            span = self._pull_span(kind, holder)
            try:
                with trace.use_span(span, end_on_exit=False):
                    handle = await self._pull_handle(params, holder, span)
                    staged = await self._plan_pull(request, handle, kind, prepared, span) if handle else None
            except BaseException:
                end_transfer_span(span, None)
                raise
            if handle is None:
                span.end()
        hold_key = f"{request.request_id}#{next(self._hold_keys)}" if params.hold_for_decode else ""
        if staged is None and not hold_key:
            return prepared
        pull, order = staged if staged is not None else (None, None)
        self.engine.stage(request.request_id, TransferOrder(transfer_id=request.request_id, hold_key=hold_key,
                                                            pull=order),
                          partial(self._on_loaded, pull, prepared, span) if pull is not None else None)
        prepared.staged_request_id = request.request_id
        return prepared

    async def _plan_pull(self, request: GenerateRequest, handle: KvHandle, kind: TransferKind, prepared: Prepared,
                         span: trace.Span) -> tuple[Pull, PullOrder] | None:
        """The pull and the read to stage; None when there is nothing to read (the pull's
        outcome is then final)."""
        await self.leases.refuse_if_incompatible(handle)
        pull = Pull.begin(self.worker_id, request.request_id, handle, kind, len(request.token_ids), takes_tail=True,
                          started=time.monotonic())
        if pull.wanted == 0:  # neither a full block nor the partial one (a prompt that ended before it)
            pull.nothing_to_read(time.monotonic())
        elif not await self.leases.ensure_agent(handle.holder_worker_id, handle.agent_name):
            pull.nothing_arrived(time.monotonic(), "holder unreachable")
        else:
            metadata = self.peers.metadata_of(handle.agent_name)
            assert metadata is not None
            return pull, PullOrder(lease_id=handle.lease_id, agent_name=handle.agent_name, agent_metadata=metadata,
                                   block_ids=pull.remote_block_ids, checksums=pull.checksums,
                                   tail_tokens=pull.tail_tokens, block_size=handle.block_size)
        self._finish(pull, prepared, span)
        return None

    def _on_loaded(self, pull: Pull, prepared: Prepared, span: trace.Span, report: Loaded | None,
                   why_none: str) -> None:
        """The engine's callback, before the request's first output (or when it ended without)."""
        now = time.monotonic()
        if report is None and why_none == "cancelled":
            pull.cancelled(now, why_none)
        elif report is None:  # nothing is known to have arrived: all of it is computed
            pull.nothing_arrived(now, why_none)
        else:
            pull.skip(report.cached_blocks)
            if not report.ok:
                pull.nothing_to_read(now)
            else:
                ok = list(report.ok)  # the first read's failures are not reported apart
                pull.landed(VerifiedRead(landed=ok, first_ok=ok, ok=ok, nbytes=report.nbytes, reason=report.reason,
                                         retried=report.retried, recovered=report.recovered), now)
                # vLLM took every block before the first failed one (its computed prefix has no holes)
                pull.committed([index < report.used_blocks for index in range(len(ok))])
        self._finish(pull, prepared, span)

    def _finish(self, pull: Pull, prepared: Prepared, span: trace.Span) -> None:
        """Count the pull and end its span, then release its lease and publish its record (in
        the background: this runs on the engine's output path)."""
        pull.fill(prepared)
        self._count(prepared)
        pull.log_failures()
        span.set_attributes(pull.span_attributes())
        end_transfer_span(span, pull.record())
        with trace.use_span(span, end_on_exit=False):  # the release and the record carry its context
            self._background(self._release_and_publish(pull))

    async def _release_and_publish(self, pull: Pull) -> None:
        pull.released(await self.leases.release(pull.handle, *pull.release()))
        await self._publish(pull.record())

    def hold(self, request: GenerateRequest) -> KvHandle | None:
        """Lease the prompt blocks vLLM pinned when the prefill finished (the engine keeps them
        until its stream closes). Call it on the final output, before awaiting anything."""
        held = self.engine.take_held(request.request_id)
        if held is None:
            return None
        return self.holder.grant_held("decode", held, prompt_chain(request, self.block_size))

    def release_pins(self, prepared: Prepared) -> None:
        """Called once `generate()` was called, and when the request ends: an order the engine
        never took (the request failed before `generate()` accepted it) is taken back here.
        Nothing is pinned in this process: vLLM references loaded blocks itself."""
        request_id, prepared.staged_request_id = prepared.staged_request_id, ""
        if not request_id:
            return
        staged = self.engine.unstage(request_id)
        if staged is not None and staged.on_loaded is not None:
            staged.on_loaded(None, "cancelled")
        if staged is not None and staged.order.release_key:  # pushed blocks the request never took
            self.engine.kv_link.unpin_soon([staged.order.release_key])

    def rank_transfers(self) -> list[RankTransfers]:
        """Each model-worker rank's NIXL agent counters, as its latest pull or push report
        carried them (`ConnectorLink.rank_transfers`): nothing asks vLLM's ranks."""
        return self.engine.kv_link.rank_transfers()

    def _background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- push mode (see connector.vllm.push) ---------------------------------------------

    async def push_receiver(self, request: GenerateRequest) -> VllmPushReceiver:
        """Decode side: vLLM pins one fresh block per full prompt block for the writer (none
        if its pool cannot spare them: then the writer sends nothing and vLLM computes all)."""
        return self._expect_push(await self._push.receiver(request))

    async def _commit_push(self, request: GenerateRequest, receiver: VllmPushReceiver,
                           receipt: PushReceipt) -> Prepared:
        return await self._push.commit(request, receiver, receipt)

    def _give_back(self, receiver: VllmPushReceiver) -> None:
        self._push.give_back(receiver)

    @property
    def _block_nbytes(self) -> int:
        return self.engine.kv_link.shape.model_block_nbytes

    def _push_writer(self, request: GenerateRequest, target: PushTarget) -> VllmPushWriter:
        return self._push.writer(request, target)

    async def ensure_push_peer(self, target: PushTarget) -> bool:
        """The reader's agent metadata; then the push is staged with the engine."""
        writer = self._push.take_writer(target.transfer_id)
        if not await super().ensure_push_peer(target):
            return False
        metadata = self.peers.metadata_of(target.agent_name)
        assert metadata is not None
        if writer is not None:
            writer.stage(metadata)
        return True
