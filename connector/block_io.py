"""The block-I/O port of the KV data plane, and the read half of every pull, written once.

`BlockReader` is the port: read these remote blocks into these local blocks and say which
landed (a `TransferResult` within the timeout, never an exception for a failed read).
Implemented by every `connector.transport.KvTransport` (the sim's data plane reads through
its transport) and by vLLM's page mapping (`connector.vllm.connector_worker.PageReads`:
NIXL reads of every layer's page of each block, in vLLM's model worker). Fault injection wraps
the port the same way for both engines (`connector.faults.FaultInjectingReader`).

`read_verified` is a pull's read: read the blocks, verify each against the holder's
checksum (`connector.block_reader`), read the failed ones again (`connector.retry`), and
report per block whether it landed sound. Its caller: `connector.shaped_read.read_units`,
every pull's read (the sim's `connector.puller.KvPuller` on the worker's loop, vLLM's
`connector.vllm.rank_loads.RankLoads` on its loader thread, in that thread's own event
loop). The rest of the pull (lease, commit, outcome, record) is `connector.pull.Pull`, for
both engines; a `VerifiedRead` is what it is told the read left (vLLM's, rebuilt from the
`Loaded` report).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import msgspec

from connector.block_reader import verified_blocks
from connector.retry import retry_async
from connector.transport import TransferResult
from shared.config import KvRetryConfig

log = logging.getLogger(__name__)


class BlockReader(Protocol):
    async def read(self, peer: str, remote_block_ids: list[int], local_block_ids: list[int], *,
                   timeout_s: float) -> TransferResult: ...


class VerifiedRead(msgspec.Struct, kw_only=True):
    """What a pull's read left in the local blocks."""

    landed: list[bool]  # per block, the first read: its bytes landed (before verification)
    first_ok: list[bool]  # per block, the first read: landed and verified
    ok: list[bool]  # per block, in the end: landed and verified (retries included)
    nbytes: int  # moved by every read
    reason: str  # why the first read failed blocks ("" once every block is sound)
    retried: int  # blocks read again
    recovered: int  # of those, blocks that then landed and verified


async def read_verified(reader: BlockReader, checksum: Callable[[int], int], peer: str, remote_block_ids: list[int],
                        local_block_ids: list[int], checksums: list[int], *, retry: KvRetryConfig,
                        timeout_s: float) -> VerifiedRead:
    """Read the blocks, verify them, read the failed ones again (same holder, same local
    blocks, bounded by `retry` and `timeout_s`)."""
    first = await reader.read(peer, remote_block_ids, local_block_ids, timeout_s=timeout_s)
    ok = verified_blocks(first.ok, local_block_ids, checksums, checksum)
    moved = [first.nbytes]
    reason = first.reason or ("checksum mismatch" if ok != list(first.ok) else "")
    first_ok = list(ok)

    async def read_again(indices: list[int], timeout_s: float) -> list[bool]:
        local = [local_block_ids[index] for index in indices]
        again = await reader.read(peer, [remote_block_ids[index] for index in indices], local, timeout_s=timeout_s)
        moved[0] += again.nbytes
        return verified_blocks(again.ok, local, [checksums[index] for index in indices], checksum)

    retried = await retry_async(retry, ok, read_again, cap_s=timeout_s)
    if retried.recovered:
        log.info("%d of %d failed block(s) from %s recovered on retry", retried.recovered, retried.retried, peer)
        reason = reason if False in ok else ""
    return VerifiedRead(landed=list(first.ok), first_ok=first_ok, ok=ok, nbytes=moved[0], reason=reason,
                        retried=retried.retried, recovered=retried.recovered)
