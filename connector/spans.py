"""Spans of the KV hand-off, the same for every engine's data plane.

- `kv.pull` (reader, child of the request's `worker.generate`): one pull of a P/D handle or
  a cached prefix, ended with its `TransferRecord`'s figures (`transfer_attributes`) and the
  blocks that failed to arrive or failed verification (`connector.pull.Pull`). Started by
  the sim's `connector.sim.worker_kv.WorkerKv` and vLLM's `connector.vllm.worker_kv.VllmWorkerKv`.
- `kv.lease.grant` (holder): a lease granted, by `connector.holder.LeaseHolder._lease`,
  under the holder's span for the reader's lease request, or under the prefill's
  `worker.generate` for a P/D hold.
- `kv.lease.request` / `kv.lease.release` / `kv.lease.extend` / `kv.agent_info` (holder):
  a lease message answered, continuing the sender's trace from the NATS headers.
- `kv.push` (writer: the sim's `connector.push.PushWriter`, one event per layer write, and
  vLLM's `connector.vllm.push.VllmPushWriter`), ended by `connector.push_ledger.end_push`;
  `kv.push.receive` (reader): the wait for the writer and the commit, its block figures
  from `connector.push_receipt.PushReceipt`.

Attribute names are `tandem.kv.*`.
"""

from __future__ import annotations

from opentelemetry import trace

from shared.schemas.transfer import TransferRecord

tracer = trace.get_tracer("tandem.kv")


def transfer_attributes(record: TransferRecord) -> dict[str, str | int | float]:
    return {"tandem.kv.kind": record.kind, "tandem.kv.peer_worker_id": record.peer_worker_id,
            "tandem.kv.outcome": record.outcome, "tandem.kv.blocks": record.blocks,
            "tandem.kv.blocks_ok": record.blocks_ok, "tandem.kv.bytes": record.bytes,
            "tandem.kv.duration_s": record.duration_s, "tandem.kv.pulled_tokens": record.pulled_tokens,
            "tandem.kv.recomputed_tokens": record.recomputed_tokens, "tandem.kv.reason": record.reason}


def end_transfer_span(span: trace.Span, record: TransferRecord | None) -> None:
    """Record the transfer's figures (if it got that far) and end the span, once."""
    if not span.is_recording():
        return
    if record is not None:
        span.set_attributes(transfer_attributes(record))
    span.end()


def block_failures(landed: list[bool], verified: list[bool], first: int = 0) -> dict[str, list[int] | int]:
    """Which blocks (indices into the handle) did not arrive, and which arrived corrupt."""
    failed = [first + index for index, ok in enumerate(landed) if not ok]
    corrupt = [first + index for index, (ok, good) in enumerate(zip(landed, verified)) if ok and not good]
    return {"tandem.kv.blocks_failed": len(failed), "tandem.kv.blocks_corrupt": len(corrupt),
            "tandem.kv.failed_blocks": failed, "tandem.kv.corrupt_blocks": corrupt}
