"""Data of the KV agent contract: its config, the metadata a peer needs, transfer results.

Pure data, importable without NIXL installed: the transfer protocol and metrics can speak
about transfers on a machine that cannot make them.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

import msgspec

from shared.errors import ErrorCode
from shared.schemas.common import Message

MemType = Literal["DRAM", "VRAM"]


class KvAgentConfig(msgspec.Struct, frozen=True, kw_only=True):
    backends: tuple[str, ...] = ("UCX",)
    # NIXL's Python API hardcodes a zero delay, and its UCX progress thread then polls
    # without sleeping: one core per agent. With a delay the thread sleeps in poll() on
    # UCX's event fd, woken by traffic, and at least once per delay (NIXL's guard against a
    # missed wake-up). Transfers and notifications do not wait for it (measured: the first
    # read including connection set-up takes ~0.5 ms with a 1 s delay).
    progress_delay_us: int = 10_000
    transfer_threads: int = 1  # executor threads behind the async wrappers
    default_timeout_s: float = 5.0

    def validate(self) -> None:
        if not self.backends:
            raise ValueError("at least one NIXL backend is needed")
        if self.progress_delay_us <= 0:
            raise ValueError("progress_delay_us must be positive: zero makes NIXL's progress thread spin")
        if self.transfer_threads < 1:
            raise ValueError("transfer_threads must be at least 1")
        if self.default_timeout_s <= 0:
            raise ValueError("default_timeout_s must be positive")


class PoolInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Where a worker's KV pool lives: block `b` is at `base_addr + b * block_nbytes`."""

    base_addr: int
    block_nbytes: int
    num_blocks: int
    mem_type: MemType = "DRAM"
    device_id: int = 0

    @property
    def nbytes(self) -> int:
        return self.block_nbytes * self.num_blocks


class AgentMetadata(Message, kw_only=True):
    """What `KvAgent.metadata()` returns (msgpack): NIXL's own metadata plus the pool
    geometry, so a peer can address blocks by id. ~0.5 KB; travels over NATS as is."""

    agent_name: str
    nixl_metadata: bytes
    pool: PoolInfo


class TransferOutcome(str, Enum):
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class TransferResult(msgspec.Struct, frozen=True, kw_only=True):
    """The one outcome of a transfer. After FAILED or CANCELLED the destination blocks may
    hold part of the data: they are garbage until written again."""

    outcome: TransferOutcome
    peer: str
    num_blocks: int
    nbytes: int
    descriptors: int  # after coalescing adjacent blocks
    elapsed_s: float
    error: ErrorCode | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome is TransferOutcome.DONE

    @property
    def gbps(self) -> float:
        return self.nbytes / self.elapsed_s / 1e9 if self.ok and self.elapsed_s > 0 else 0.0
