"""Pull and push bandwidth of KV blocks in GPU memory through `NixlTransport`, one or two
processes: 256 blocks of 1 MiB, timed for 1, 16 and 256 blocks (best of 3), checksums
compared. Needs CUDA, torch and NIXL; not a test (pytest does not collect it).

    python tests/gpu/nixl_bandwidth_probe.py one|two [dram]

"one": both agents in this process; "two": the holder in a spawned process (as prefill and
decode workers are); "dram": host pools instead of GPU pools, for comparison. UCX settings
come from the environment (UCX_TLS, UCX_PROTO_INFO=y, ...). bench/results/h100-nixl-vram.md
holds what it printed on an H100.
"""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import sys
import time
import zlib
from typing import Any

import numpy as np
import torch

from connector.nixl_transport import NixlTransport

BLOCK = 1 << 20
N = 256


def make(name: str, pool: Any) -> NixlTransport:
    return NixlTransport(name, pool, BLOCK, BLOCK // 4, progress_delay_us=10_000, transfer_timeout_s=60)


def filled_pool(device_pool: bool) -> Any:
    if device_pool:
        return (torch.arange(N * BLOCK, device="cuda") % 251).to(torch.uint8).reshape(N, BLOCK)
    return (np.arange(N * BLOCK) % 251).astype(np.uint8).reshape(N, BLOCK)


def crc(pool: Any) -> int:
    if isinstance(pool, torch.Tensor):
        torch.cuda.synchronize()
        return zlib.crc32(pool.cpu().numpy())
    return zlib.crc32(pool)


def holder_main(conn: Any, device_pool: bool) -> None:
    pool = filled_pool(device_pool)
    holder = make("holder", pool)
    conn.send(holder.metadata())
    holder.add_peer("reader", conn.recv())
    conn.send("ready")
    conn.recv()
    conn.send(crc(pool))
    holder.close()


def best_of(transfer: Any, repeats: int = 3) -> tuple[Any, float]:
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        result = asyncio.run(transfer())
        best = min(best, time.perf_counter() - began)
        assert result.outcome == "done", result.reason
    return result, best


def main(two_process: bool, device_pool: bool) -> None:
    label = f"{'two' if two_process else 'one'}-process {'VRAM' if device_pool else 'DRAM'}"
    pool = torch.zeros((N, BLOCK), dtype=torch.uint8, device="cuda") if device_pool else \
        np.zeros((N, BLOCK), dtype=np.uint8)
    reader = make("reader", pool)
    if two_process:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=holder_main, args=(child, device_pool))
        proc.start()
        reader.add_peer("holder", parent.recv())
        parent.send(reader.metadata())
        assert parent.recv() == "ready"
    else:
        source = filled_pool(device_pool)
        holder = make("holder", source)
        reader.add_peer("holder", holder.metadata())
        holder.add_peer("reader", reader.metadata())
    ids = list(range(N))
    asyncio.run(reader.read("holder", ids[:4], ids[:4], timeout_s=60))  # connection set-up
    for n in (1, 16, 256):
        result, best = best_of(lambda: reader.read("holder", ids[:n], ids[:n], timeout_s=60))
        print(f"{label} pull {n} MiB: {best * 1000:.2f} ms, {result.nbytes / best / 1e9:.1f} GB/s", flush=True)
    result, best = best_of(lambda: reader.write("holder", ids, ids, timeout_s=60))
    print(f"{label} push 256 MiB: {best * 1000:.2f} ms, {result.nbytes / best / 1e9:.1f} GB/s", flush=True)
    mine = crc(pool)
    if two_process:
        parent.send("crc")
        theirs = parent.recv()
        proc.join(30)
    else:
        theirs = crc(source)
        holder.close()
    print(f"{label} checksums equal: {mine == theirs}", flush=True)
    reader.close()


if __name__ == "__main__":
    main("two" in sys.argv[1:], "dram" not in sys.argv[1:])
