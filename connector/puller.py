"""The sim's driver of a pull (`connector.pull.Pull`): lease or take a handle, read, verify,
release, commit, all in-process.

Used by the sim data plane (`connector.sim.worker_kv.WorkerKv`) before the worker computes
a request, for engines with an in-process `KvPort`: the decode worker of a P/D pair pulls the
prompt's blocks from the prefill worker; any worker may pull a cached prefix from the
worker that holds it, whatever either's shape. The holder's blocks are the pull's units;
they land in blocks of this worker's own size (`connector.token_map.aligned_span`: whole
blocks of both sides), each local rank reading its heads and layers from the holder ranks
that hold them (`connector.shaped_read.ShapedRead`). The read is
`connector.shaped_read.read_units` (vLLM's ranks read through it too): units that fail to
arrive or to verify against the holder's per-head checksums are read once more
(`connector.retry`, bounded in time), then simply not committed, so the engine computes
exactly those. The lease is released before the commit, so the blocks of a lease that
expired meanwhile are never used. The outcome, the record and the span's figures are the
`Pull`'s, the same as vLLM's.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from opentelemetry import trace

from connector.faults import ReadFaults
from connector.lease_client import LeaseClient
from connector.port import KvPort
from connector.pull import Pull
from connector.rank_transports import RankTransports
from connector.shaped_read import read_units
from connector.token_map import Segments, Span, aligned_span, token_segments
from shared.block_hash import block_hash_chain, chain_root
from shared.config import KvFaultConfig, KvRetryConfig
from shared.schemas.transfer import KvHandle, TransferKind


@dataclass(slots=True)
class PullOutcome:
    """What a pull left behind for the request: blocks to unpin when it ends, and the pull."""

    pinned_block_ids: list[int]
    pull: Pull


class KvPuller:
    """Reads a handle's blocks through this worker's rank transports into blocks the port
    allocates; the lease half (grants, releases, agent metadata) is the shared `LeaseClient`."""

    def __init__(self, leases: LeaseClient, port: KvPort, agents: RankTransports, *,
                 transfer_timeout_s: float = 10.0, retry: KvRetryConfig = KvRetryConfig(),
                 faults: KvFaultConfig = KvFaultConfig()) -> None:
        self.leases = leases
        self.worker_id = leases.worker_id
        self.block_size = leases.block_size
        self._port = port
        self._agents = agents
        self._transfer_timeout_s = transfer_timeout_s
        self._retry = retry
        self._faults = ReadFaults(faults)
        self._tasks: set[asyncio.Task] = set()  # releases sent after a cancellation

    async def pull(self, request_id: str, handle: KvHandle, token_ids: list[int], *, kind: TransferKind = "pull",
                   adapter: str = "", cache_salt: str = "") -> PullOutcome:
        """Bring the handle's blocks into the local cache; always releases the lease."""
        await self.leases.refuse_if_incompatible(handle)
        pull = Pull.begin(self.worker_id, request_id, handle, kind, len(token_ids), takes_tail=False,
                          started=time.monotonic())
        local_hashes = block_hash_chain(token_ids[:pull.wanted * handle.block_size], self.block_size,
                                        parent_hash=chain_root(adapter, cache_salt))
        pinned = self._port.pin_prefix(local_hashes)  # already cached here: not pulled
        span = aligned_span(handle.block_size, self.block_size, pull.wanted, len(pinned))
        pull.narrow(span.first_unit, span.units)
        targets = self._port.allocate_for_transfer(span.local_blocks) if span.units else None
        segments = None
        if not span.units:
            pull.nothing_to_read(time.monotonic())
        elif targets is None:
            pull.no_free_blocks(time.monotonic())
        else:
            segments = token_segments(pull.remote_block_ids, handle.block_size, targets, self.block_size,
                                      span.units * handle.block_size)
            await self._read(pull, segments, targets, pinned)
        pull.released(await self._release(pull, pinned + (targets or [])))
        if targets is not None and segments is not None:  # read (or tried to)
            pinned += self._commit(pull, span, segments, targets, token_ids, adapter, cache_salt)
        pull.log_failures()
        trace.get_current_span().set_attributes(pull.span_attributes())  # the pull's
        return PullOutcome(pinned_block_ids=pinned, pull=pull)

    async def _read(self, pull: Pull, segments: Segments, targets: list[int], pinned: list[int]) -> None:
        """Read the units into `targets`; a request cancelled meanwhile gives everything back."""
        handle = pull.handle
        try:
            peer = self._agents.peer_of(handle.agent_name) if await self.leases.ensure_agent(
                handle.holder_worker_id, handle.agent_name) else None
            if peer is None:
                pull.nothing_arrived(time.monotonic(), "holder unreachable")
                return
            read = await read_units(self._agents.local_ranks, peer, segments, pull.blocks,
                                    agent_name=handle.agent_name, remote_block_ids=pull.remote_block_ids,
                                    checksums=pull.checksums, faults=self._faults, retry=self._retry,
                                    timeout_s=self._transfer_timeout_s)
        except asyncio.CancelledError:
            pull.cancelled(time.monotonic())
            self._port.unpin(pinned + targets)
            self._background(self.leases.release(handle, *pull.release()))
            raise
        pull.landed(read, time.monotonic())

    def _commit(self, pull: Pull, span: Span, segments: Segments, targets: list[int], token_ids: list[int],
                adapter: str, cache_salt: str) -> list[int]:
        """Commit what the pull may use (after the release: not the blocks of an expired
        lease); unpin the rest at once. The committed blocks, which stay pinned."""
        local_ok = segments.destination_ok(pull.usable(), len(targets))
        committed = self._port.commit_transferred(targets, span.first_local, token_ids, local_ok, adapter=adapter,
                                                  cache_salt=cache_salt)
        pull.committed(segments.units_ok(committed, pull.blocks))
        self._port.unpin([block_id for block_id, good in zip(targets, committed) if not good])
        return [block_id for block_id, good in zip(targets, committed) if good]

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
