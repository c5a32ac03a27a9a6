"""Reader side of the KV hand-off: lease (or take a handle), pull, verify, commit, release.

Used by the sim data plane (`connector.sim.worker_kv.WorkerKv`) before the worker computes
a request, for engines with an in-process `KvPort`: the decode worker of a P/D pair pulls the
prompt's blocks from the prefill worker; any worker may pull a cached prefix from the
worker that holds it. Blocks that fail to arrive or to verify are read once more
(`connector.retry`, bounded in time), then simply not committed, so the engine computes
exactly those. Every pull ends with one explicit outcome, sent to
the holder as a `LeaseRelease` and published as a `TransferRecord`.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from opentelemetry import trace

from connector.block_io import BlockReader, VerifiedRead, read_verified
from connector.lease_client import LeaseClient
from connector.port import KvPort
from connector.spans import block_failures
from shared.config import KvRetryConfig
from shared.schemas.transfer import KvHandle, TransferKind, TransferOutcome, TransferRecord

log = logging.getLogger(__name__)


class PullOutcome(msgspec.Struct, kw_only=True):
    """What a pull left behind for the request: blocks to unpin when it ends, and counts."""

    pinned_block_ids: list[int]
    record: TransferRecord | None = None

    @property
    def pulled_tokens(self) -> int:
        return self.record.pulled_tokens if self.record else 0

    @property
    def recomputed_tokens(self) -> int:
        return self.record.recomputed_tokens if self.record else 0

    @property
    def retried_blocks(self) -> int:
        return self.record.blocks_retried if self.record else 0

    @property
    def recovered_blocks(self) -> int:
        return self.record.blocks_recovered if self.record else 0


class KvPuller:
    """Reads a handle's blocks through the block-I/O port (`connector.block_io`: the worker's
    transport) into blocks the port allocates; the lease half (grants, releases, agent
    metadata) is the shared `LeaseClient`."""

    def __init__(self, leases: LeaseClient, port: KvPort, reader: BlockReader, *,
                 transfer_timeout_s: float = 10.0, retry: KvRetryConfig = KvRetryConfig()) -> None:
        self.leases = leases
        self.worker_id = leases.worker_id
        self.block_size = leases.block_size
        self._port = port
        self._reader = reader
        self._transfer_timeout_s = transfer_timeout_s
        self._retry = retry
        self._tasks: set[asyncio.Task] = set()  # releases sent after a cancellation

    async def pull(self, request_id: str, handle: KvHandle, token_ids: list[int], *, kind: TransferKind = "pull",
                   adapter: str = "") -> PullOutcome:
        """Bring the handle's blocks into the local cache; always releases the lease."""
        started = time.monotonic()
        await self.leases.refuse_if_incompatible(handle)
        wanted = min(len(handle.block_ids), len(token_ids) // self.block_size)
        local = self._port.pin_prefix(handle.block_hashes[:wanted])  # already cached here: not pulled
        pinned = [block_id for block_id, _ in local]
        first = len(local)
        count = wanted - first
        if count <= 0:
            await self._release(handle, "done", pinned)
            return PullOutcome(pinned_block_ids=pinned, record=self._record(
                request_id, handle, kind, "done", 0, 0, 0, started, reason="already cached"))
        targets = self._port.allocate_for_transfer(count)
        if targets is None:
            await self._release(handle, "cancelled", pinned)
            return PullOutcome(pinned_block_ids=pinned, record=self._record(
                request_id, handle, kind, "cancelled", count, 0, 0, started, reason="no free blocks"))
        try:
            if not await self.leases.ensure_agent(handle.holder_worker_id, handle.agent_name):
                read = VerifiedRead(landed=[False] * count, first_ok=[False] * count, ok=[False] * count, nbytes=0,
                                    reason="holder unreachable", retried=0, recovered=0)
            else:
                read = await read_verified(self._reader, self._port.checksum, handle.agent_name,
                                           handle.block_ids[first:wanted], targets, handle.checksums[first:wanted],
                                           retry=self._retry, timeout_s=self._transfer_timeout_s)
                trace.get_current_span().set_attributes(block_failures(read.landed, read.first_ok, first))  # the pull's
        except asyncio.CancelledError:  # the request was cancelled mid-pull: give everything back
            self._port.unpin(pinned + targets)
            self._background(self.leases.release(handle, "cancelled"))
            raise
        ok, reason = read.ok, read.reason
        landed_failed = [first + i for i, good in enumerate(ok) if not good]
        lease_held = await self._release(handle, "done" if not landed_failed else "failed", pinned + targets,
                                         landed_failed)
        if lease_held is False:  # expired under us: what we read may be another request's KV
            ok, reason = [False] * count, "lease expired before the pull ended"
        parent = handle.block_hashes[first - 1] if first else None
        committed = self._port.commit_transferred(targets, handle.block_hashes[first:wanted],
                                                  token_ids[first * self.block_size: wanted * self.block_size],
                                                  parent, ok, adapter=adapter)
        failed = [first + i for i, good in enumerate(committed) if not good]
        self._port.unpin([block_id for block_id, good in zip(targets, committed) if not good])
        pinned += [block_id for block_id, good in zip(targets, committed) if good]
        outcome: TransferOutcome = "done" if not failed else ("expired" if lease_held is False else "failed")
        reason = reason or (f"{len(failed)} block(s) failed verification" if failed else "")
        if failed:
            log.warning("%s: pull of %s from %s: %d of %d block(s) failed (%s); they will be computed",
                        self.worker_id, request_id, handle.holder_worker_id, len(failed), count, reason)
        if read.retried:
            trace.get_current_span().set_attributes({"tandem.kv.blocks_retried": read.retried,
                                                     "tandem.kv.blocks_recovered": read.recovered})
        record = self._record(request_id, handle, kind, outcome, count, count - len(failed), read.nbytes, started,
                              reason=reason)
        return PullOutcome(pinned_block_ids=pinned, record=msgspec.structs.replace(
            record, blocks_retried=read.retried, blocks_recovered=read.recovered))

    async def _release(self, handle: KvHandle, outcome: TransferOutcome, pinned: list[int],
                       failed_blocks: list[int] = ()) -> bool | None:
        """Release the lease; a request cancelled meanwhile gives back the blocks this pull
        pinned (the caller never sees them)."""
        try:
            return await self.leases.release(handle, outcome, failed_blocks)
        except BaseException:
            self._port.unpin(pinned)
            raise

    def _background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _record(self, request_id: str, handle: KvHandle, kind: TransferKind, outcome: TransferOutcome, blocks: int,
                blocks_ok: int, nbytes: int, started: float, *, reason: str = "") -> TransferRecord:
        return TransferRecord(worker_id=self.worker_id, request_id=request_id, kind=kind,
                              peer_worker_id=handle.holder_worker_id, outcome=outcome, blocks=blocks,
                              blocks_ok=blocks_ok, bytes=nbytes, duration_s=time.monotonic() - started,
                              pulled_tokens=blocks_ok * self.block_size,
                              recomputed_tokens=(blocks - blocks_ok) * self.block_size, reason=reason)
