"""Transfer benchmark: KvAgent reads against raw NIXL reads of the same blocks, in one run.

Two processes: a holder (spawned) owns a KV pool filled with a known pattern, the calling
process reads it. Per layout (adjacent block ids, scattered = random permutations) the
reader alternates, repetition by repetition:
  - connector: `KvAgent.read_blocks` (coalesces adjacent blocks into one descriptor);
  - connector_ranges: `KvAgent.read_ranges` of the same bytes, one row per block, as a
    planner for workers of unlike shapes would hand it (adjacent rows merge);
  - raw_nixl: the straight NIXL call sequence with one descriptor per block
    (descriptor lists -> createXferReq -> post -> poll -> release);
  - raw_nixl_prepped: descriptor lists prepared once per side, then makeXferReq with
    block indices per transfer (NIXL merges adjacent descriptors itself).
All four share one NIXL agent and connection, so they differ only in the call pattern.
Then both processes sit idle and report their CPU use; a process with a stock
`nixl_agent` (the Python API's defaults) is measured the same way for comparison.

`run_transfer_bench(...) -> dict` is the entry point (`tandem bench transfer --json`);
`python -m bench.transfer` prints the same JSON.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import multiprocessing
import resource
import statistics
import time
from collections.abc import Callable
from importlib import metadata as package_metadata
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from connector.agent_types import KvAgentConfig
from connector.nixl_agent import KvAgent, load_nixl

HOLDER = "bench-holder"
READER = "bench-reader"
GOAL_RATIO = 0.8
GOAL_IDLE_CPU_PERCENT = 5.0


def process_cpu_seconds() -> float:
    """CPU time of this process, all threads (NIXL's and UCX's included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def idle_cpu_percent(seconds: float) -> float:
    """Sleep for `seconds` and return the CPU this process used meanwhile, in % of a core."""
    cpu, wall = process_cpu_seconds(), time.perf_counter()
    time.sleep(seconds)
    return 100.0 * (process_cpu_seconds() - cpu) / (time.perf_counter() - wall)


def pool_pattern(num_blocks: int, block_nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, num_blocks * block_nbytes, dtype=np.uint8)


def _holder_main(conn: Connection, num_blocks: int, block_nbytes: int, seed: int,
                 config: KvAgentConfig) -> None:
    pool = pool_pattern(num_blocks, block_nbytes, seed)
    with KvAgent(HOLDER, config) as agent:
        agent.register_pool(pool, block_nbytes)
        conn.send_bytes(agent.metadata())
        agent.add_peer(READER, conn.recv_bytes())
        while (command := conn.recv()) != "stop":
            conn.send(idle_cpu_percent(command))


def _stock_agent_main(conn: Connection, num_blocks: int, block_nbytes: int, seconds: float) -> None:
    """An agent built the way NIXL's Python API builds it by default, for comparison."""
    api = importlib.import_module(load_nixl().__name__.rsplit(".", 1)[0] + "._api")
    api.logger.setLevel(logging.WARNING)  # its INFO lines go to stdout, into the JSON
    pool = np.zeros(num_blocks * block_nbytes, dtype=np.uint8)
    agent = api.nixl_agent("bench-stock")
    registration = agent.register_memory([(pool.ctypes.data, pool.nbytes, 0, "")], "DRAM")
    conn.send(idle_cpu_percent(seconds))
    agent.deregister_memory(registration)


class _RawReader:
    """Straight NIXL calls on the KvAgent's own bindings agent and connection."""

    def __init__(self, agent: KvAgent, peer: str) -> None:
        self.nixl = load_nixl()
        self.agent = agent.nixl_agent
        self.peer = peer
        self.local = agent.pool
        self.remote = agent.peer_pool(peer)
        assert self.remote is not None
        self.prepped: tuple[int, int] | None = None

    def _rows(self, base_addr: int, block_ids: np.ndarray) -> np.ndarray:
        rows = np.zeros((block_ids.size, 3), dtype=np.uint64)
        rows[:, 0] = base_addr + block_ids.astype(np.uint64) * self.local.block_nbytes
        rows[:, 1] = self.local.block_nbytes
        return rows

    def _wait(self, handle: int) -> None:
        nixl = self.nixl
        status = self.agent.postXferReq(handle)
        while status == nixl.NIXL_IN_PROG:
            status = self.agent.getXferStatus(handle)
        self.agent.releaseXferReq(handle)
        assert status == nixl.NIXL_SUCCESS, status

    def read(self, remote_ids: np.ndarray, local_ids: np.ndarray) -> None:
        nixl = self.nixl
        handle = self.agent.createXferReq(
            nixl.NIXL_READ, nixl.nixlXferDList(nixl.DRAM_SEG, self._rows(self.local.base_addr, local_ids)),
            nixl.nixlXferDList(nixl.DRAM_SEG, self._rows(self.remote.base_addr, remote_ids)), self.peer, "", [])
        self._wait(handle)

    def read_prepped(self, remote_ids: np.ndarray, local_ids: np.ndarray) -> None:
        nixl = self.nixl
        if self.prepped is None:  # once per peer, as a serving system would
            every = np.arange(self.local.num_blocks)
            local = self.agent.prepXferDlist(
                nixl.NIXL_INIT_AGENT, nixl.nixlXferDList(nixl.DRAM_SEG, self._rows(self.local.base_addr, every)), [])
            every = np.arange(self.remote.num_blocks)
            remote = self.agent.prepXferDlist(
                self.peer, nixl.nixlXferDList(nixl.DRAM_SEG, self._rows(self.remote.base_addr, every)), [])
            self.prepped = (local, remote)
        local, remote = self.prepped
        handle = self.agent.makeXferReq(nixl.NIXL_READ, local, local_ids.astype(np.int32), remote,
                                        remote_ids.astype(np.int32), "", [], False)
        self._wait(handle)

    def close(self) -> None:
        if self.prepped is not None:
            for handle in self.prepped:
                self.agent.releasedDlistH(handle)
            self.prepped = None


def _timed_in_rotation(variants: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[float]]:
    """Each variant's seconds per repetition, run back to back in an order that rotates by one
    per repetition."""
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for repeat in range(repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:  # rotate the order: no position bias
            started = time.perf_counter()
            variants[name]()
            seconds[name].append(time.perf_counter() - started)
    return seconds


def _measure_layout(agent: KvAgent, raw: _RawReader, expected: np.ndarray, pool: np.ndarray,
                    remote_ids: np.ndarray, local_ids: np.ndarray, repeats: int) -> dict[str, Any]:
    block = agent.pool.block_nbytes
    nbytes = remote_ids.size * block
    descriptors = {"connector": 0, "connector_ranges": 0}
    remote_offsets, local_offsets = remote_ids * block, local_ids * block
    lengths = np.full(remote_ids.size, block, dtype=np.int64)

    def connector() -> None:
        result = agent.read_blocks(HOLDER, remote_ids, local_ids, timeout_s=30.0)
        assert result.ok, result
        descriptors["connector"] = result.descriptors

    def connector_ranges() -> None:
        result = agent.read_ranges(HOLDER, remote_offsets, local_offsets, lengths, timeout_s=30.0)
        assert result.ok, result
        descriptors["connector_ranges"] = result.descriptors

    variants: dict[str, Callable[[], None]] = {
        "connector": connector,
        "connector_ranges": connector_ranges,
        "raw_nixl": lambda: raw.read(remote_ids, local_ids),
        "raw_nixl_prepped": lambda: raw.read_prepped(remote_ids, local_ids),
    }
    verified = True
    for variant in variants.values():  # warm-up, and each path must deliver the right bytes
        pool[:] = 0
        variant()
        got = pool.reshape(-1, block)[local_ids]
        verified &= bool(np.array_equal(got, expected.reshape(-1, block)[remote_ids]))
    seconds = _timed_in_rotation(variants, repeats)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    gbps = {name: nbytes / value / 1e9 for name, value in median.items()}

    def paired_ratio(baseline: str, variant: str = "connector") -> float:
        # Median of per-repetition ratios: each pair ran back to back, so load from other
        # processes that drifts over the run cancels out.
        return statistics.median(b / c for b, c in zip(seconds[baseline], seconds[variant]))

    return {
        **{f"{name}_gbps": round(value, 3) for name, value in gbps.items()},
        "ratio": round(paired_ratio("raw_nixl"), 3),
        "ratio_vs_prepped": round(paired_ratio("raw_nixl_prepped"), 3),
        "ranges_ratio_vs_prepped": round(paired_ratio("raw_nixl_prepped", "connector_ranges"), 3),
        **{f"{name}_p50_ms": round(value * 1e3, 3) for name, value in median.items()},
        "connector_descriptors": descriptors["connector"],
        "connector_ranges_descriptors": descriptors["connector_ranges"],
        "raw_nixl_descriptors": int(remote_ids.size),
        "verified": verified,
    }


def run_transfer_bench(*, num_blocks: int = 1024, block_nbytes: int = 16 * 1024, repeats: int = 40,
                       idle_seconds: float = 5.0, seed: int = 0, compare_stock_agent: bool = True,
                       config: KvAgentConfig | None = None) -> dict[str, Any]:
    # DRAM pools: CUDA-IPC reads do not apply, and where UCX has no CUDA transport it warns on
    # stdout about their variable, into the JSON.
    config = config or KvAgentConfig(cuda_ipc_reads=False)
    context = multiprocessing.get_context("spawn")
    conn, holder_conn = context.Pipe()
    holder = context.Process(target=_holder_main, name=HOLDER, daemon=True,
                             args=(holder_conn, num_blocks, block_nbytes, seed, config))
    holder.start()
    try:
        report = _read_from_holder(conn, num_blocks, block_nbytes, repeats, idle_seconds, seed, config)
    finally:
        holder.join(10)
        if holder.is_alive():
            holder.kill()
            holder.join()
    if compare_stock_agent:
        report["idle_cpu_percent_stock_nixl_agent"] = round(_stock_idle_cpu(context, idle_seconds), 3)
    return {
        "bench": "transfer",
        "nixl": _nixl_version(),
        "backends": list(config.backends),
        "progress_delay_us": config.progress_delay_us,
        "num_blocks": num_blocks,
        "block_nbytes": block_nbytes,
        "total_bytes": num_blocks * block_nbytes,
        "repeats": repeats,
        "idle_seconds": idle_seconds,
        **report,
        "goals": {
            "ratio_min": GOAL_RATIO,
            "idle_cpu_percent_max": GOAL_IDLE_CPU_PERCENT,
            "met": all(layout["ratio"] >= GOAL_RATIO and layout["verified"] for layout in report["layouts"].values())
            and report["idle_cpu_percent"] < GOAL_IDLE_CPU_PERCENT,
        },
    }


def _read_from_holder(conn: Connection, num_blocks: int, block_nbytes: int, repeats: int, idle_seconds: float,
                      seed: int, config: KvAgentConfig) -> dict[str, Any]:
    """The reader's side, the holder process running: each layout's reads timed and verified,
    then both processes' CPU while idle with a registered pool and a connected peer; the
    holder is told to stop."""
    report: dict[str, Any] = {}
    if not conn.poll(60):
        raise RuntimeError("the holder process sent no metadata within 60 s")
    holder_metadata = conn.recv_bytes()
    pool = np.zeros(num_blocks * block_nbytes, dtype=np.uint8)
    expected = pool_pattern(num_blocks, block_nbytes, seed)
    rng = np.random.default_rng(seed + 1)
    layouts = {
        "adjacent": (np.arange(num_blocks), np.arange(num_blocks)),
        "scattered": (rng.permutation(num_blocks), rng.permutation(num_blocks)),
    }
    with KvAgent(READER, config) as agent:
        agent.register_pool(pool, block_nbytes)
        agent.add_peer(HOLDER, holder_metadata)
        conn.send_bytes(agent.metadata())
        raw = _RawReader(agent, HOLDER)
        try:
            report["layouts"] = {name: _measure_layout(agent, raw, expected, pool, remote, local, repeats)
                                 for name, (remote, local) in layouts.items()}
        finally:
            raw.close()
        # Both processes idle with a registered pool and a connected peer.
        reader_cpu = process_cpu_seconds()
        started = time.perf_counter()
        conn.send(idle_seconds)
        if not conn.poll(idle_seconds + 30):
            raise RuntimeError("the holder process did not report its idle CPU")
        report["idle_cpu_percent"] = round(conn.recv(), 3)
        report["idle_cpu_percent_reader"] = round(
            100.0 * (process_cpu_seconds() - reader_cpu) / (time.perf_counter() - started), 3)
    conn.send("stop")
    return report


def _stock_idle_cpu(context: Any, seconds: float) -> float:
    conn, child_conn = context.Pipe()
    process = context.Process(target=_stock_agent_main, args=(child_conn, 64, 4096, seconds), daemon=True)
    process.start()
    try:
        if not conn.poll(seconds + 60):
            raise RuntimeError("the stock-agent process did not report")
        return conn.recv()
    finally:
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join()


def _nixl_version() -> str:
    package = load_nixl().__name__.split(".", 1)[0].replace("_", "-")
    try:
        return f"{package} {package_metadata.version(package)}"
    except package_metadata.PackageNotFoundError:
        return package


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1024)
    parser.add_argument("--block-bytes", type=int, default=16 * 1024)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    parser.add_argument("--progress-delay-us", type=int, default=KvAgentConfig().progress_delay_us)
    parser.add_argument("--no-stock", action="store_true", help="skip the stock nixl_agent idle CPU comparison")
    parser.add_argument("--json", action="store_true", help="one JSON object (the default output anyway)")
    args = parser.parse_args(argv)
    report = run_transfer_bench(num_blocks=args.blocks, block_nbytes=args.block_bytes, repeats=args.repeats,
                                idle_seconds=args.idle_seconds, compare_stock_agent=not args.no_stock,
                                config=KvAgentConfig(progress_delay_us=args.progress_delay_us, cuda_ipc_reads=False))
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
