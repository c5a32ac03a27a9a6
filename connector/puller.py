"""The sim's driver of a pull (`connector.pull.Pull`): lease or take a handle, read, verify,
release, commit, all in-process.

Used by the sim data plane (`connector.sim.worker_kv.WorkerKv`) before the worker computes
a request, for engines with an in-process `KvPort`: the decode worker of a P/D pair pulls the
prompt's blocks from the prefill worker; any worker may pull a cached prefix from the
worker that holds it. The read is `connector.block_io.read_verified` through the worker's
transport: blocks that fail to arrive or to verify are read once more (`connector.retry`,
bounded in time), then simply not committed, so the engine computes exactly those. The lease
is released before the commit, so the blocks of a lease that expired meanwhile are never
used. The outcome, the record and the span's figures are the `Pull`'s, the same as vLLM's.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from opentelemetry import trace

from connector.block_io import BlockReader, read_verified
from connector.lease_client import LeaseClient
from connector.port import KvPort
from connector.pull import Pull
from shared.config import KvRetryConfig
from shared.schemas.transfer import KvHandle, TransferKind


@dataclass(slots=True)
class PullOutcome:
    """What a pull left behind for the request: blocks to unpin when it ends, and the pull."""

    pinned_block_ids: list[int]
    pull: Pull


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
        await self.leases.refuse_if_incompatible(handle)
        pull = Pull.begin(self.worker_id, request_id, handle, kind, len(token_ids), takes_tail=False,
                          started=time.monotonic())
        local = self._port.pin_prefix(handle.block_hashes[:pull.wanted])  # already cached here: not pulled
        pinned = [block_id for block_id, _ in local]
        pull.skip(len(local))
        targets = self._port.allocate_for_transfer(pull.blocks) if pull.blocks else None
        if not pull.blocks:
            pull.nothing_to_read(time.monotonic())
        elif targets is None:
            pull.no_free_blocks(time.monotonic())
        else:
            await self._read(pull, targets, pinned)
        pull.released(await self._release(pull, pinned + (targets or [])))
        if targets is not None:  # read (or tried to)
            self._commit(pull, targets, token_ids, adapter)
            pinned += [block_id for block_id, good in zip(targets, pull.committed_ok or []) if good]
        pull.log_failures()
        trace.get_current_span().set_attributes(pull.span_attributes())  # the pull's
        return PullOutcome(pinned_block_ids=pinned, pull=pull)

    async def _read(self, pull: Pull, targets: list[int], pinned: list[int]) -> None:
        """Read the blocks into `targets`; a request cancelled meanwhile gives everything back."""
        try:
            if not await self.leases.ensure_agent(pull.handle.holder_worker_id, pull.handle.agent_name):
                pull.nothing_arrived(time.monotonic(), "holder unreachable")
                return
            read = await read_verified(self._reader, self._port.checksum, pull.handle.agent_name,
                                       pull.remote_block_ids, targets, pull.checksums, retry=self._retry,
                                       timeout_s=self._transfer_timeout_s)
        except asyncio.CancelledError:
            pull.cancelled(time.monotonic())
            self._port.unpin(pinned + targets)
            self._background(self.leases.release(pull.handle, *pull.release()))
            raise
        pull.landed(read, time.monotonic())

    def _commit(self, pull: Pull, targets: list[int], token_ids: list[int], adapter: str) -> None:
        """Commit what the pull may use (after the release: not the blocks of an expired
        lease); unpin the rest at once."""
        first, wanted, size = pull.first, pull.wanted, self.block_size
        parent = pull.handle.block_hashes[first - 1] if first else None
        pull.committed(self._port.commit_transferred(targets, pull.handle.block_hashes[first:wanted],
                                                     token_ids[first * size: wanted * size], parent, pull.usable(),
                                                     adapter=adapter))
        self._port.unpin([block_id for block_id, good in zip(targets, pull.committed_ok or []) if not good])

    async def _release(self, pull: Pull, pinned: list[int]) -> bool | None:
        """Release the lease; a request cancelled meanwhile gives back the blocks this pull
        pinned (the caller never sees them)."""
        try:
            return await self.leases.release(pull.handle, *pull.release())
        except BaseException:
            self._port.unpin(pinned)
            raise

    def _background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
