"""Data of the KV agent contract: its config, the metadata a peer needs, transfer results
and the agent's transfer counters.

Pure data, importable without NIXL installed: the transfer protocol and metrics can speak
about transfers on a machine that cannot make them.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

import msgspec
import numpy as np

from shared.errors import ErrorCode
from shared.schemas.common import Message
from shared.schemas.load import RankTransfers, TransferTotals

MemType = Literal["DRAM", "VRAM"]
TransferOp = Literal["READ", "WRITE"]
MAX_SPIN_US = 10_000


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
    # How long a transfer's wait polls NIXL without sleeping before it backs off (sleeps of
    # 20 us doubling to 1 ms). A transfer from GPU memory is always in progress after its
    # post and often done within tens of microseconds: a sleep there added 0.16-0.25 ms to
    # each (H200, 16 MiB: 56 GB/s against raw NIXL's 308 GB/s). The back-off after it keeps
    # a long transfer from costing a core.
    spin_us: int = 200
    # The same when either pool is in GPU memory. The copy engines finish a transfer in a
    # time that grows with its size (a 512 MiB read in 0.3 ms on an H200), and a sleep adds
    # up to 0.1 ms to it; raw NIXL callers poll to the end. A transfer still running after
    # this costs a core no longer.
    vram_spin_us: int = 5_000
    # Let UCX read GPU memory over CUDA IPC without NVLink (UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y
    # unless the operator set it): UCX's `auto` turns those reads off there, and a pull from
    # GPU memory then crawls at 0.3-0.5 GB/s (1,197 GB/s with it on, H200). No effect on DRAM.
    cuda_ipc_reads: bool = True

    def spin_us_between(self, local: MemType, remote: MemType) -> int:
        """How long a transfer between pools in these memories polls without sleeping."""
        return self.vram_spin_us if "VRAM" in (local, remote) else self.spin_us

    def validate(self) -> None:
        if not self.backends:
            raise ValueError("at least one NIXL backend is needed")
        if self.progress_delay_us <= 0:
            raise ValueError("progress_delay_us must be positive: zero makes NIXL's progress thread spin")
        if self.transfer_threads < 1:
            raise ValueError("transfer_threads must be at least 1")
        if self.default_timeout_s <= 0:
            raise ValueError("default_timeout_s must be positive")
        for name in ("spin_us", "vram_spin_us"):
            if not 0 <= getattr(self, name) <= MAX_SPIN_US:
                raise ValueError(f"{name} must be in [0, {MAX_SPIN_US}]: a longer spin holds a core per transfer")


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

    @classmethod
    def of(cls, buffer: Any, block_nbytes: int) -> PoolInfo:
        """Where `buffer` lives: C-contiguous host memory (a numpy array, DRAM), or GPU memory
        (anything with `__cuda_array_interface__`, VRAM on the buffer's device). ValueError
        for a buffer that is not contiguous or not a whole number of blocks."""
        cuda = getattr(buffer, "__cuda_array_interface__", None)
        if cuda is None:
            if not isinstance(buffer, np.ndarray) or not buffer.flags.c_contiguous:
                raise ValueError("the KV pool must be a C-contiguous numpy array or a contiguous CUDA array")
            base_addr, nbytes, mem_type, device_id = buffer.ctypes.data, buffer.nbytes, "DRAM", 0
        else:
            if cuda.get("strides") is not None:  # None means C-contiguous in the interface
                raise ValueError("the KV pool must be contiguous")
            base_addr = int(cuda["data"][0])
            nbytes = int(np.prod(cuda["shape"])) * np.dtype(cuda["typestr"]).itemsize
            mem_type, device_id = "VRAM", int(getattr(getattr(buffer, "device", None), "index", None) or 0)
        if block_nbytes <= 0 or nbytes % block_nbytes:
            raise ValueError(f"pool of {nbytes} bytes is not a whole number of {block_nbytes}-byte blocks")
        return cls(base_addr=base_addr, block_nbytes=block_nbytes, num_blocks=nbytes // block_nbytes,
                   mem_type=mem_type, device_id=device_id)


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
    num_blocks: int  # 0 for a byte-range transfer
    nbytes: int
    descriptors: int  # after coalescing adjacent blocks or ranges
    elapsed_s: float
    error: ErrorCode | None = None
    detail: str = ""

    @classmethod
    def refused(cls, peer: str, outcome: TransferOutcome, error: ErrorCode, detail: str) -> TransferResult:
        """A transfer that never started (closed agent, unknown or unfit peer): nothing moved."""
        return cls(outcome=outcome, peer=peer, num_blocks=0, nbytes=0, descriptors=0, elapsed_s=0.0, error=error,
                   detail=detail)

    @property
    def ok(self) -> bool:
        return self.outcome is TransferOutcome.DONE

    @property
    def gbps(self) -> float:
        return self.nbytes / self.elapsed_s / 1e9 if self.ok and self.elapsed_s > 0 else 0.0


class TransferCounts(msgspec.Struct, frozen=True, kw_only=True):
    """One direction's transfers since the agent started. `transfers` counts every result
    returned, whatever its outcome; `nbytes`, `seconds` and `descriptors` add up the DONE
    ones only (so nbytes / seconds is their throughput); `failed` and `cancelled` count the
    others by outcome."""

    transfers: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    descriptors: int = 0
    failed: int = 0
    cancelled: int = 0

    def counted(self, result: TransferResult) -> TransferCounts:
        done = result.ok
        return TransferCounts(
            transfers=self.transfers + 1,
            nbytes=self.nbytes + result.nbytes if done else self.nbytes,
            seconds=self.seconds + result.elapsed_s if done else self.seconds,
            descriptors=self.descriptors + result.descriptors if done else self.descriptors,
            failed=self.failed + (result.outcome is TransferOutcome.FAILED),
            cancelled=self.cancelled + (result.outcome is TransferOutcome.CANCELLED))


class AgentStats(msgspec.Struct, frozen=True, kw_only=True):
    """`KvAgent.stats`: a snapshot of its transfer counters, reads (this agent pulled) and
    writes (it pushed) apart. Immutable: the agent swaps in a new one per transfer."""

    reads: TransferCounts = msgspec.field(default_factory=TransferCounts)
    writes: TransferCounts = msgspec.field(default_factory=TransferCounts)

    def counted(self, op: TransferOp, result: TransferResult) -> AgentStats:
        if op == "READ":
            return AgentStats(reads=self.reads.counted(result), writes=self.writes)
        return AgentStats(reads=self.reads, writes=self.writes.counted(result))

    def of_rank(self, rank: int) -> RankTransfers:
        """These counters as a worker's load snapshot carries them for its KV rank `rank`."""
        return RankTransfers(rank=rank, reads=TransferTotals(**msgspec.structs.asdict(self.reads)),
                             writes=TransferTotals(**msgspec.structs.asdict(self.writes)))
