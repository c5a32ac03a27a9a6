"""Fault injection as a wrapper of the block-I/O port: breaks transfers as configured, so
failure handling is exercised through the production code path. Reads: `FaultInjectingReader`,
around any `connector.block_io.BlockReader`, the same for both engines (the sim's transport,
through `FaultInjectingTransport`; vLLM's pages, in `connector.vllm.connector_worker`).
Writes: one rule (`write_faults`) for the sim's push (`FaultInjectingTransport`) and vLLM's
(`connector.vllm.connector_push`).

- `fail_fraction`: chosen blocks are reported failed and their landed bytes scribbled over
  (a partly written block is garbage);
- `corrupt_fraction`: chosen blocks land with wrong bytes but are reported fine (only the
  reader's checksum verification can catch them);
- `fail_transfer`: the whole transfer fails;
- `delay_s`: every transfer starts late (lease expiry, timeouts);
- `cut_after_blocks`: the transfer breaks after that many blocks, as when the peer dies.

Which blocks are chosen is a pure function of (seed, remote block id), so runs repeat.
With `fail_times` = 0 a chosen block fails every read (a permanent fault: reading it again
does not help); with n > 0 it fails its first n reads by this reader, then reads fine (a
transient fault: a retry recovers it). Blocks cut off by `cut_after_blocks` count as
chosen on later reads; a read of blocks already cut off is not cut again. That state is a
`ReadFaults`, one per reader.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from connector.block_io import BlockReader
from connector.transport import KvTransport, Offsets, TransferResult
from shared.config import KvFaultConfig


def chosen(seed: int, salt: str, block_id: int, fraction: float) -> bool:
    if fraction <= 0:
        return False
    digest = hashlib.blake2b(f"{seed}:{salt}:{block_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


class WriteFaults(msgspec.Struct, frozen=True, kw_only=True):
    """Positions of a write's blocks: those to write, and those to report failed."""

    written: list[int]
    failed: list[int]


def write_faults(config: KvFaultConfig, remote_block_ids: Sequence[int]) -> WriteFaults:
    """The one write rule of both engines' writers (the sim's `FaultInjectingTransport`,
    vLLM's `connector.vllm.connector_push`), chosen by the reader's block ids: a block chosen
    to fail is not written and is reported failed; one chosen to corrupt is not written but
    reported written (only the reader's checksum catches it)."""
    written, failed = [], []
    for position, remote in enumerate(remote_block_ids):
        if chosen(config.seed, "fail", remote, config.fail_fraction):
            failed.append(position)
        elif not chosen(config.seed, "corrupt", remote, config.corrupt_fraction):
            written.append(position)
    return WriteFaults(written=written, failed=failed)


def blocks_before_cut(config: KvFaultConfig, count: int) -> int:
    """How many blocks of a `count`-block read are copied before the injected cut."""
    return count if config.cut_after_blocks is None else min(count, config.cut_after_blocks)


class ReadFaults:
    """One reader's injected read faults: which blocks misbehave on this read. Remembers,
    per (holder agent, holder block id), the reads a chosen block has failed (transient
    faults) and the blocks a cut left unread."""

    def __init__(self, config: KvFaultConfig) -> None:
        self.config = config
        self._failures: dict[tuple[str, int], int] = {}
        self._cut: set[tuple[str, int]] = set()

    def blocks_before_cut(self, peer: str, remote_block_ids: Sequence[int]) -> int:
        """How many blocks of this read are copied before the injected cut; the rest are
        remembered as cut off (they already failed once)."""
        keys = [(peer, remote) for remote in remote_block_ids]
        if self.config.cut_after_blocks is None or any(key in self._cut for key in keys):
            return len(keys)
        cut = blocks_before_cut(self.config, len(keys))
        for key in keys[cut:]:
            self._cut.add(key)
            self._failures[key] = self._failures.get(key, 0) + 1
        return cut

    def _misbehaves(self, key: tuple[str, int]) -> bool:
        """A chosen block fails this read: always (permanent), or while under `fail_times`."""
        failures = self._failures.get(key, 0)
        if self.config.fail_times and failures >= self.config.fail_times:
            return False
        self._failures[key] = failures + 1
        return True

    def inject(self, peer: str, remote_block_ids: Sequence[int], local_block_ids: Sequence[int], ok: list[bool],
               scribble: Callable[[int], None]) -> bool:
        """After a read: scribble over every local block that did not land (partly written
        blocks are garbage), fail the chosen ones and corrupt others without saying so (only
        the reader's checksum catches those). Chosen by the holder's block ids. Updates `ok`;
        returns whether injection failed a block."""
        config = self.config
        injected = False
        for index, (remote, local) in enumerate(zip(remote_block_ids, local_block_ids)):
            key = (peer, remote)
            if not ok[index]:
                scribble(local)
            elif (key in self._cut or chosen(config.seed, "fail", remote, config.fail_fraction)) \
                    and self._misbehaves(key):
                ok[index], injected = False, True
                scribble(local)
            elif chosen(config.seed, "corrupt", remote, config.corrupt_fraction) and self._misbehaves(key):
                scribble(local)  # reported fine: only checksums catch it
        return injected


def inject_read_faults(config: KvFaultConfig, remote_block_ids: Sequence[int], local_block_ids: Sequence[int],
                       ok: list[bool], scribble: Callable[[int], None]) -> bool:
    """`ReadFaults.inject` for one read with no history (every chosen block fails)."""
    return ReadFaults(config).inject("", remote_block_ids, local_block_ids, ok, scribble)


class FaultInjectingReader:
    """The block-I/O port (`connector.block_io.BlockReader`) with read faults injected: the
    one wrapper both engines' readers go through (the sim's transport, vLLM's pages).
    `scribble(local_block_id)` makes a local block garbage."""

    def __init__(self, inner: BlockReader, faults: ReadFaults, scribble: Callable[[int], None]) -> None:
        self._inner = inner
        self._faults = faults
        self._scribble = scribble

    async def read(self, peer: str, remote_block_ids: list[int], local_block_ids: list[int], *,
                   timeout_s: float) -> TransferResult:
        config = self._faults.config
        if config.delay_s:
            await asyncio.sleep(config.delay_s)
        if config.fail_transfer:
            return TransferResult(outcome="failed", ok=[False] * len(local_block_ids), reason="injected: transfer failed")
        count = len(local_block_ids)
        cut = self._faults.blocks_before_cut(peer, remote_block_ids)
        result = await self._inner.read(peer, remote_block_ids[:cut], local_block_ids[:cut], timeout_s=timeout_s)
        ok = list(result.ok) + [False] * (count - cut)
        injected = self._faults.inject(peer, remote_block_ids, local_block_ids, ok, self._scribble)
        outcome = result.outcome if cut == count else "failed"
        reason = result.reason or ("injected: transfer cut" if cut < count else "") or (
            "injected: blocks failed" if injected else "")
        return TransferResult(outcome=outcome, ok=ok, nbytes=result.nbytes, duration_s=result.duration_s,
                              reason=reason)


class FaultInjectingTransport:
    """A transport whose reads go through `FaultInjectingReader` and whose writes follow
    `write_faults`. Byte-range transfers pass through to the inner transport unchanged (no
    faults injected into them yet)."""

    def __init__(self, inner: KvTransport, config: KvFaultConfig, local_buffer: np.ndarray, block_nbytes: int) -> None:
        config.validate()
        self._inner = inner
        self.config = config
        self._blocks = local_buffer.reshape(-1)[: (local_buffer.size // block_nbytes) * block_nbytes].reshape(
            -1, block_nbytes)
        self._reader = FaultInjectingReader(inner, ReadFaults(config), self._scribble)

    @property
    def agent_name(self) -> str:
        return self._inner.agent_name

    def metadata(self) -> bytes:
        return self._inner.metadata()

    def add_peer(self, name: str, metadata: bytes) -> None:
        self._inner.add_peer(name, metadata)

    def remove_peer(self, name: str) -> None:
        self._inner.remove_peer(name)

    def has_peer(self, name: str) -> bool:
        return self._inner.has_peer(name)

    def close(self) -> None:
        self._inner.close()

    def _scribble(self, local_block_id: int) -> None:
        self._blocks[local_block_id, ::7] ^= 0x5A

    async def read(self, peer: str, remote_block_ids: list[int], local_block_ids: list[int], *,
                   timeout_s: float) -> TransferResult:
        return await self._reader.read(peer, remote_block_ids, local_block_ids, timeout_s=timeout_s)

    async def write(self, peer: str, local_block_ids: list[int], remote_block_ids: list[int], *,
                    timeout_s: float, layer: int | None = None) -> TransferResult:
        config = self.config
        if config.delay_s:
            await asyncio.sleep(config.delay_s)
        if config.fail_transfer:
            return TransferResult(outcome="failed", ok=[False] * len(local_block_ids), reason="injected: transfer failed")
        faults = write_faults(config, remote_block_ids)
        result = await self._inner.write(peer, [local_block_ids[i] for i in faults.written],
                                         [remote_block_ids[i] for i in faults.written], timeout_s=timeout_s,
                                         layer=layer)
        ok = [position not in faults.failed for position in range(len(local_block_ids))]
        for position, index in enumerate(faults.written):
            ok[index] = result.ok[position]
        return TransferResult(outcome=result.outcome, ok=ok, nbytes=result.nbytes, duration_s=result.duration_s,
                              reason=result.reason)

    async def read_ranges(self, peer: str, remote_offsets: Offsets, local_offsets: Offsets, lengths: Offsets, *,
                          timeout_s: float) -> TransferResult:
        return await self._inner.read_ranges(peer, remote_offsets, local_offsets, lengths, timeout_s=timeout_s)

    async def write_ranges(self, peer: str, remote_offsets: Offsets, local_offsets: Offsets, lengths: Offsets, *,
                           timeout_s: float) -> TransferResult:
        return await self._inner.write_ranges(peer, remote_offsets, local_offsets, lengths, timeout_s=timeout_s)
