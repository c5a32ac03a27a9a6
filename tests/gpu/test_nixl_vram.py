"""KV blocks in GPU memory over real NIXL: two `NixlTransport`s whose pools are CUDA tensors
(registered as VRAM), pull (READ), push (WRITE) and one layer pushed, bytes compared by
per-block CRC-32.

Needs a CUDA device, torch and NIXL (nixl-cu12 or nixl-cu13); skipped otherwise, so CI,
which has no GPU, never runs it. On a GPU machine: `python -m pytest -s tests/gpu`.
"""

from __future__ import annotations

import asyncio
import time
import zlib

import pytest

from connector.nixl_agent import nixl_available
from connector.nixl_transport import NixlTransport

torch = pytest.importorskip("torch", reason="torch is not installed")
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed (pip install nixl-cu12)"),
]

NUM_BLOCKS = 64
LAYERS = 4
LAYER_NBYTES = 64 * 1024
BLOCK_NBYTES = LAYERS * LAYER_NBYTES
TIMEOUT_S = 10.0


def gpu_pool(seed: int, num_blocks: int = NUM_BLOCKS, block_nbytes: int = BLOCK_NBYTES):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (num_blocks, block_nbytes), dtype=torch.uint8, device="cuda", generator=generator)


def checksums(pool, block_ids: list[int]) -> list[int]:
    torch.cuda.synchronize()
    host = pool[block_ids].cpu().numpy()
    return [zlib.crc32(row) for row in host]


def transport(name: str, pool, layer_nbytes: int = LAYER_NBYTES) -> NixlTransport:
    return NixlTransport(name, pool, pool.shape[1], layer_nbytes, progress_delay_us=10_000,
                         transfer_timeout_s=TIMEOUT_S)


@pytest.fixture
def pair():
    pools = {"prefill": gpu_pool(1), "decode": gpu_pool(2)}
    sides = {name: transport(f"vram-{name}", pool) for name, pool in pools.items()}
    sides["prefill"].add_peer("vram-decode", sides["decode"].metadata())
    sides["decode"].add_peer("vram-prefill", sides["prefill"].metadata())
    yield sides, pools
    for side in sides.values():
        side.close()


def test_pool_is_registered_as_vram(pair) -> None:
    sides, _ = pair
    pool = sides["decode"]._agent.pool
    assert pool.mem_type == "VRAM" and pool.num_blocks == NUM_BLOCKS and pool.block_nbytes == BLOCK_NBYTES
    assert sides["prefill"]._agent.peer_pool("vram-decode").mem_type == "VRAM"


def test_pull_reads_peer_blocks_from_gpu_memory(pair) -> None:
    sides, pools = pair
    remote, local = [3, 4, 5, 9, 17], [10, 11, 12, 40, 2]
    expected = checksums(pools["prefill"], remote)
    assert checksums(pools["decode"], local) != expected
    result = asyncio.run(sides["decode"].read("vram-prefill", remote, local, timeout_s=TIMEOUT_S))
    assert result.outcome == "done" and all(result.ok), result.reason
    assert result.nbytes == len(remote) * BLOCK_NBYTES
    assert checksums(pools["decode"], local) == expected


def test_push_writes_blocks_into_peer_gpu_memory(pair) -> None:
    sides, pools = pair
    local, remote = [0, 1, 2, 50], [30, 31, 32, 7]
    untouched = checksums(pools["decode"], [33, 8])
    result = asyncio.run(sides["prefill"].write("vram-decode", local, remote, timeout_s=TIMEOUT_S))
    assert result.outcome == "done" and all(result.ok), result.reason
    assert checksums(pools["decode"], remote) == checksums(pools["prefill"], local)
    assert checksums(pools["decode"], [33, 8]) == untouched


def test_push_one_layer_touches_only_that_layer(pair) -> None:
    sides, pools = pair
    before = pools["decode"][40].clone()
    result = asyncio.run(sides["prefill"].write("vram-decode", [5], [40], timeout_s=TIMEOUT_S, layer=2))
    assert result.outcome == "done" and result.nbytes == LAYER_NBYTES, result.reason
    torch.cuda.synchronize()
    layer = slice(2 * LAYER_NBYTES, 3 * LAYER_NBYTES)
    assert torch.equal(pools["decode"][40][layer], pools["prefill"][5][layer])
    outside = torch.ones(BLOCK_NBYTES, dtype=torch.bool, device="cuda")
    outside[layer] = False
    assert torch.equal(pools["decode"][40][outside], before[outside])


def test_unknown_peer_is_a_failed_result(pair) -> None:
    sides, _ = pair
    result = asyncio.run(sides["decode"].read("nobody", [1], [1], timeout_s=TIMEOUT_S))
    assert result.outcome == "failed" and result.ok == [False]


def test_large_pull_bandwidth() -> None:
    """256 blocks of 1 MiB in one pull: the bytes land and the rate is printed (with -s)."""
    source, target = gpu_pool(3, 256, 1 << 20), gpu_pool(4, 256, 1 << 20)
    holder, reader = transport("vram-holder", source, 1 << 18), transport("vram-reader", target, 1 << 18)
    try:
        reader.add_peer("vram-holder", holder.metadata())
        blocks = list(range(256))
        asyncio.run(reader.read("vram-holder", blocks[:8], blocks[:8], timeout_s=TIMEOUT_S))  # connection set-up
        began = time.perf_counter()
        result = asyncio.run(reader.read("vram-holder", blocks, blocks, timeout_s=TIMEOUT_S))
        elapsed = time.perf_counter() - began
        assert result.outcome == "done", result.reason
        assert checksums(target, [0, 100, 255]) == checksums(source, [0, 100, 255])
        print(f"\nVRAM pull: {result.nbytes / 2**20:.0f} MiB in {elapsed * 1000:.2f} ms "
              f"= {result.nbytes / elapsed / 1e9:.1f} GB/s (transfer {result.duration_s * 1000:.2f} ms)")
    finally:
        holder.close()
        reader.close()
