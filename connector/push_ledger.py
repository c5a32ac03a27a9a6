"""The writer's account of one push, written once for every engine (pure: no I/O): per
block of the reader's target (its index in `PushTarget.block_ids`), the local block it
comes from, the layers sent, and whether a write failed; at the end, what is still to be
sent whole, and the per-block outcome and checksums the reader is told.

Kept by the sim's `connector.push.PushWriter` (on the worker's loop) and by vLLM's
`connector.vllm.connector_push.PushWrites` (in the model worker: the model thread sends
layers, the writer thread marks failed writes). Layers are counted as a set per block: a
preempted request computes its blocks again and the hook reports them again, which must
not pass for the missing layers. The span of a push (`start_push`) and its end (`end_push`:
its outcome, its span's figures, the `PushDone` for the reader) are shared the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from opentelemetry import trace

from connector.spans import tracer
from shared.schemas.transfer import PushDone, PushTarget, TransferOutcome


class PushLedger:
    def __init__(self, target_blocks: int) -> None:
        self.target_blocks = target_blocks
        self.sources: dict[int, int] = {}  # target index -> local block id
        self.layers: dict[int, set[int]] = {}  # target index -> layers sent
        self.failed: set[int] = set()  # target indices with a failed write

    def source(self, indices: Iterable[int], local_block_ids: Iterable[int]) -> None:
        for index, local in zip(indices, local_block_ids):
            self.sources[index] = local

    def sent(self, indices: Iterable[int], layer: int) -> None:
        for index in indices:
            self.layers.setdefault(index, set()).add(layer)

    def fail(self, indices: Iterable[int]) -> None:
        self.failed.update(indices)

    def fail_all(self) -> None:
        self.failed.update(range(self.target_blocks))

    def unsent(self, num_layers: int) -> list[int]:
        """Sourced blocks some layer of which was not sent (the engine reused them from its
        cache, or a hook missed them): to send whole, every layer at once."""
        return [index for index in sorted(self.sources) if len(self.layers.get(index, ())) < num_layers]

    def ok(self) -> list[bool]:
        """Per target block: it has a source and no write of it failed."""
        return [index in self.sources and index not in self.failed for index in range(self.target_blocks)]

    def failed_blocks(self) -> list[int]:
        return [index for index, ok in enumerate(self.ok()) if not ok]

    def checksums(self, checksums_of: Callable[[list[int]], list[int]], heads: int) -> list[int]:
        """The writer's checksums of each target block's source, head by head (zeros: none);
        `checksums_of(block_ids)` gives them flat, block by block."""
        sourced = [index for index in range(self.target_blocks) if index in self.sources]
        values = checksums_of([self.sources[index] for index in sourced]) if sourced else []
        flat = [0] * (self.target_blocks * heads)
        for position, index in enumerate(sourced):
            flat[index * heads:(index + 1) * heads] = values[position * heads:(position + 1) * heads]
        return flat


def start_push(target: PushTarget) -> trace.Span:
    """The writer's `kv.push` span, for both engines, under the prefill's `worker.generate`;
    ended by `end_push` or `abort_push`."""
    return tracer.start_span("kv.push", attributes={
        "tandem.kv.kind": "push", "tandem.kv.peer_worker_id": target.reader_worker_id,
        "tandem.kv.transfer_id": target.transfer_id, "tandem.kv.blocks": len(target.block_ids)})


def end_push(span: trace.Span, transfer_id: str, first_token: int | None, checksums: list[int], failed: list[int],
             *, writes: int, nbytes: int, reason: str = "") -> PushDone:
    """The writer's end of a push, for both engines: its outcome, its `kv.push` span's
    figures (then ended), and the `PushDone` the reader verifies against."""
    outcome: TransferOutcome = "done" if not failed else "failed"
    span.set_attributes({"tandem.kv.outcome": outcome, "tandem.kv.blocks_failed": len(failed),
                         "tandem.kv.failed_blocks": failed, "tandem.kv.writes": writes, "tandem.kv.bytes": nbytes,
                         "tandem.kv.reason": reason})
    span.end()
    return PushDone(transfer_id=transfer_id, outcome=outcome, checksums=checksums, first_token=first_token,
                    failed_blocks=failed)


def abort_push(span: trace.Span) -> None:
    if span.is_recording():
        span.set_attribute("tandem.kv.outcome", "aborted")
        span.end()
