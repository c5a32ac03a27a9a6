"""Where a transfer bench pool lives: host memory (a numpy array, NIXL's DRAM) or GPU memory
(a torch CUDA uint8 tensor, NIXL's VRAM), behind one small interface the bench uses on both
sides; and the device-to-device copy that GPU transfers are compared with.

torch is imported only for GPU memory: the DRAM bench needs numpy alone.
"""

from __future__ import annotations

import zlib
from typing import Any, Literal

import numpy as np

Memory = Literal["dram", "vram"]
MEMORIES: tuple[Memory, ...] = ("dram", "vram")


def pool_pattern(num_blocks: int, block_nbytes: int, seed: int) -> np.ndarray:
    """`num_blocks * block_nbytes` random bytes, the same for a seed on every host."""
    return np.frombuffer(np.random.default_rng(seed).bytes(num_blocks * block_nbytes), dtype=np.uint8)


def require_cuda() -> None:
    """RuntimeError unless torch is installed and sees a CUDA device."""
    try:
        _torch()
    except ImportError as error:
        raise RuntimeError(f"--memory vram needs torch with CUDA: {error}") from error


def _torch() -> Any:
    import torch  # noqa: PLC0415 (GPU memory only; the DRAM bench runs without torch)

    if not torch.cuda.is_available():
        raise RuntimeError("--memory vram needs a CUDA device and torch with CUDA")
    return torch


class BenchPool:
    """A KV pool of `num_blocks` blocks in `memory`; `buffer` is what `KvAgent.register_pool` takes."""

    def __init__(self, memory: Memory, num_blocks: int, block_nbytes: int) -> None:
        if memory not in MEMORIES:
            raise ValueError(f"memory must be one of {MEMORIES}, not {memory!r}")
        self.memory, self.num_blocks, self.block_nbytes = memory, num_blocks, block_nbytes
        if memory == "vram":
            self.buffer: Any = _torch().zeros(num_blocks * block_nbytes, dtype=_torch().uint8, device="cuda")
        else:
            self.buffer = np.zeros(num_blocks * block_nbytes, dtype=np.uint8)

    def fill(self, pattern: np.ndarray) -> None:
        if self.memory == "vram":
            self.buffer.copy_(_torch().from_numpy(pattern))
            _torch().cuda.synchronize()
        else:
            self.buffer[:] = pattern

    def zero(self) -> None:
        self.buffer.fill_(0) if self.memory == "vram" else self.buffer.fill(0)
        self.synchronize()

    def synchronize(self) -> None:
        if self.memory == "vram":
            _torch().cuda.synchronize()

    def rows(self, block_ids: np.ndarray) -> np.ndarray:
        """The blocks' bytes in host memory, one row per id in the given order."""
        if self.memory == "vram":
            self.synchronize()
            host = self.buffer.view(self.num_blocks, self.block_nbytes)[_torch().from_numpy(block_ids).cuda()]
            return host.cpu().numpy()
        return self.buffer.reshape(-1, self.block_nbytes)[block_ids]

    def digest(self, block_ids: np.ndarray) -> int:
        """CRC-32 of the blocks' bytes in the given order: two pools hold the same blocks when equal."""
        return zlib.crc32(np.ascontiguousarray(self.rows(block_ids)))


def _is_run(ids: np.ndarray) -> bool:
    return bool(ids.size) and bool(np.array_equal(ids, np.arange(ids[0], ids[0] + ids.size)))


class DeviceCopy:
    """torch copying the same blocks between two tensors on one GPU: the floor a transfer
    between two processes on that GPU is measured against. Adjacent ids on both sides are one
    slice copy; other ids a gather and a scatter (`index_select` then `index_copy_`)."""

    def __init__(self, pattern: np.ndarray, num_blocks: int, block_nbytes: int) -> None:
        torch = _torch()
        self.source = torch.from_numpy(pattern).cuda().view(num_blocks, block_nbytes)
        self.target = torch.zeros_like(self.source)

    def copy(self, source_ids: np.ndarray, target_ids: np.ndarray) -> None:
        torch = _torch()
        if _is_run(source_ids) and _is_run(target_ids):
            start, end = int(source_ids[0]), int(source_ids[0]) + source_ids.size
            into = int(target_ids[0])
            self.target[into:into + source_ids.size].copy_(self.source[start:end])
        else:
            rows = self.source.index_select(0, torch.from_numpy(source_ids).cuda())
            self.target.index_copy_(0, torch.from_numpy(target_ids).cuda(), rows)
        torch.cuda.synchronize()

    def verified(self, source_ids: np.ndarray, target_ids: np.ndarray) -> bool:
        torch = _torch()
        self.target.zero_()
        self.copy(source_ids, target_ids)
        got = self.target[torch.from_numpy(target_ids).cuda()]
        return bool(torch.equal(got, self.source[torch.from_numpy(source_ids).cuda()]))
