"""Push mode in the writer's model worker (the worker side of Tandem's vLLM connector).

A step's `PushSpec`s arrive with its connector metadata, bound before the forward pass
(`begin`; vLLM calls `start_load_kv` after it for asynchronous loads). After each attention
layer vLLM calls the connector's `save_kv_layer` (`layer_computed`): that layer of every
block the step completes is final, and this rank's share of it (its KV heads, into the
reader's ranks that hold them: `connector.range_plan.write_targets`; the reader may have
another tensor-parallel degree, not another block size) is queued for a NIXL WRITE into
the reader's blocks. One writer thread performs the writes in order while the model thread
goes on to the next layer, so layer k travels while layer k+1 is computed. At the end of
the forward pass (`end`, vLLM's `wait_for_save`) a push whose prompt is complete writes,
whole, the blocks the engine reused from its prefix cache (never computed, so no layer
hook named them) and any block a layer hook missed, waits for every write (bounded),
checksums its heads of its own copy of each block and sends its `Pushed` report (the
Tandem worker merges every rank's), before the step's output (the first token) leaves the
engine.

Faults: the sim writer's rule (`connector.faults.write_faults`, chosen by the reader's
block id): a block chosen to fail is not written and is reported failed; one chosen to
corrupt is not written but reported written (only the reader's checksum catches it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

from connector.faults import write_faults
from connector.kv_geometry import KvShape, RankGeometry
from connector.kv_peer import KvPeer
from connector.nixl_agent import KvAgent
from connector.push_ledger import PushLedger
from connector.range_plan import plan_ranges, write_targets
from connector.token_map import token_segments
from connector.vllm.kv_reports import ReportSink
from connector.vllm.kv_wire import LayerWritten, Pushed, PushSpec
from shared.config import KvFaultConfig

log = logging.getLogger(__name__)


class _Push:
    """One push across the steps that compute its prompt."""

    def __init__(self, spec: PushSpec, num_layers: int) -> None:
        self.transfer_id = spec.transfer_id
        self.agent_name = spec.agent_name
        self.reader: KvPeer | None = None
        self.target = spec.target_block_ids
        self.num_layers = num_layers
        self.started = time.perf_counter()
        self.ledger = PushLedger(len(self.target))  # sources, layers queued, failed writes
        self.writes: list[Future[None]] = []
        self.timings: list[LayerWritten] = []
        self.nbytes = 0
        self.reason = ""
        self.lock = threading.Lock()

    def since(self, at: float) -> float:
        return at - self.started


class _Step:
    """What one step of one push writes per layer (blocks chosen to fail left out)."""

    def __init__(self, push: _Push, indices: list[int], local: list[int], remote: list[int]) -> None:
        self.push = push
        self.indices = indices
        self.local = local
        self.remote = remote


class PushWrites:
    def __init__(self, agent: Callable[[], KvAgent], rank: Callable[[], RankGeometry], shape: Callable[[], KvShape],
                 peer_of: Callable[[str, bytes], KvPeer], block_checksums: Callable[[list[int]], list[int]],
                 faults: KvFaultConfig, reports: ReportSink, timeout_s: float) -> None:
        self._agent = agent
        self._rank = rank
        self._shape = shape
        self._peer_of = peer_of
        self._block_checksums = block_checksums
        self._faults = faults
        self._reports = reports
        self._timeout_s = timeout_s
        self._layer_of: dict[str, int] = {}
        self._pushes: dict[str, _Push] = {}  # transfer id -> push
        self._steps: list[_Step] = []
        self._finals: list[tuple[_Push, PushSpec]] = []
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-push")
        self.pushes = 0  # completed, for diagnostics

    def bind_layers(self, layer_of: dict[str, int]) -> None:
        self._layer_of = dict(layer_of)

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)

    # ---- one step -----------------------------------------------------------------------

    def begin(self, specs: list[PushSpec]) -> None:
        self._steps, self._finals = [], []
        shape = self._shape()
        for spec in specs:
            push = self._pushes.get(spec.transfer_id)
            if push is None:
                push = self._pushes[spec.transfer_id] = _Push(spec, shape.num_layers)
            if spec.final:
                self._finals.append((push, spec))
            if not spec.indices or push.reason:
                continue
            self._reach(push, spec)
            if push.reason:
                continue
            keep = self._keep(push, spec.indices)
            push.ledger.source(spec.indices, spec.local_block_ids)
            step = _Step(push, [spec.indices[i] for i in keep], [spec.local_block_ids[i] for i in keep],
                         [push.target[spec.indices[i]] for i in keep])
            if step.indices:
                self._steps.append(step)

    def layer_computed(self, layer_name: str) -> None:
        """vLLM's save hook, after one layer's attention: queue that layer's writes."""
        layer = self._layer_of.get(layer_name)
        if layer is None or not self._steps:
            return
        computed = time.perf_counter()
        for step in self._steps:
            step.push.ledger.sent(step.indices, layer)
            step.push.writes.append(self._thread.submit(
                self._write, step.push, layer, step.indices, step.local, step.remote, computed))

    def end(self) -> None:
        """End of the forward pass: finish the pushes whose prompt is complete."""
        self._steps = []
        finals, self._finals = self._finals, []
        for push, spec in finals:
            self._finish(push, spec)

    # ---- internals ------------------------------------------------------------------------

    def _keep(self, push: _Push, indices: list[int]) -> list[int]:
        """Positions in `indices` to write; blocks chosen to fail are marked failed."""
        faults = write_faults(self._faults, [push.target[index] for index in indices])
        push.ledger.fail(indices[position] for position in faults.failed)
        return faults.written

    def _reach(self, push: _Push, spec: PushSpec) -> None:
        """The reader's agents, once per push; a reader this rank cannot write into (its
        agents unusable, another block size) fails the push."""
        if push.reader is not None or push.reason:
            return
        try:
            push.reader = self._peer_of(spec.agent_name, spec.agent_metadata)
        except Exception as error:  # the reader's agent is unusable: nothing can be written
            push.reason = f"reader agent unusable: {error}"
            return
        if push.reader.shape.block_size != self._shape().block_size:
            push.reason = (f"the reader's {push.reader.shape.block_size}-token blocks are not this engine's "
                           f"{self._shape().block_size}: a push maps heads and layers, not block sizes")

    def _write(self, push: _Push, layer: int | None, indices: list[int], local: list[int], remote: list[int],
               computed: float) -> None:
        """On the writer thread: one layer (or every layer: None) of these blocks, this
        rank's heads into the reader's ranks that hold them."""
        started = time.perf_counter()
        agent, rank, reader = self._agent(), self._rank(), push.reader
        ok, nbytes, detail = reader is not None, 0, "" if reader is not None else "reader agent unknown"
        if reader is not None:
            size = rank.block_size
            segments = token_segments(local, size, remote, size, len(local) * size)
            layers = None if layer is None else range(layer, layer + 1)
            for part in write_targets(rank, self._shape(), reader.shape):
                plan = plan_ranges(part, segments, layers=layers)
                if not len(plan):
                    continue
                result = agent.write_ranges(reader.rank_agents[part.dst.rank], plan.dst_offsets, plan.src_offsets,
                                            plan.lengths, timeout_s=self._timeout_s)
                ok, nbytes = ok and result.ok, nbytes + (result.nbytes if result.ok else 0)
                detail = detail or ("" if result.ok else result.detail)
        with push.lock:
            push.timings.append(LayerWritten(
                layer=-1 if layer is None else layer, blocks=len(local), computed_s=push.since(computed),
                started_s=push.since(started), done_s=push.since(time.perf_counter()), ok=ok))
            push.nbytes += nbytes
            if not ok:
                push.ledger.fail(indices)
                push.reason = push.reason or detail

    def _finish(self, push: _Push, spec: PushSpec) -> None:
        ledger = push.ledger
        ledger.source(spec.whole_indices, spec.whole_local_block_ids)
        # Reused blocks, and any block a layer hook missed: every layer at once.
        missing = ledger.unsent(push.num_layers)
        if missing:
            self._reach(push, spec)
        if missing and not push.reason:
            keep = self._keep(push, missing)
            indices = [missing[i] for i in keep]
            if indices:
                push.writes.append(self._thread.submit(
                    self._write, push, None, indices, [ledger.sources[index] for index in indices],
                    [push.target[index] for index in indices], time.perf_counter()))
        done, pending = wait_futures(push.writes, timeout=self._timeout_s)
        for future in done:
            if future.exception() is not None:
                log.warning("push %s: a write raised: %s", push.transfer_id, future.exception())
                ledger.fail_all()
        if pending:
            ledger.fail_all()
            push.reason = push.reason or "writes not complete in time"
        if push.reason:
            ledger.fail(ledger.sources)
        del self._pushes[push.transfer_id]
        rank = self._rank()
        ok, checksums = ledger.ok(), ledger.checksums(self._block_checksums, rank.num_heads)
        with push.lock:
            timings = sorted(push.timings, key=lambda t: (t.started_s, t.layer))
        self.pushes += 1
        self._reports.send(Pushed(transfer_id=push.transfer_id, ok=ok, checksums=checksums, nbytes=push.nbytes,
                                  reason=push.reason, writes=timings, rank=rank.rank, heads=list(rank.heads)))
