"""Transfer benchmark: KvAgent transfers against raw NIXL transfers of the same blocks, in one run.

Two processes: a holder (spawned) owns a KV pool filled with a known pattern, the calling
process reads it (pull, READ) and then writes into it (push, WRITE). Pools live in host
memory (`--memory dram`) or GPU memory (`--memory vram`: torch CUDA tensors, both processes
on one GPU). Per operation and layout (adjacent block ids, scattered = random permutations)
the caller alternates, repetition by repetition:
  - connector: `KvAgent.read_blocks` / `write_blocks` (coalesces adjacent blocks into one
    descriptor);
  - connector_ranges: `KvAgent.read_ranges` / `write_ranges` of the same bytes, one row per
    block, as a planner for workers of unlike shapes would hand it (adjacent rows merge);
  - raw_nixl and raw_nixl_prepped: straight NIXL calls (`bench.transfer_raw`);
  - device_copy (GPU memory only): torch copying the same blocks between two tensors of
    one process on that GPU, the floor a transfer between processes is measured against.
All NIXL variants share one agent and connection, so they differ only in the call pattern.
Every variant's bytes are checked once (CRC-32 of the blocks on the receiving side). Then
both processes sit idle and report their CPU use; a process with a stock `nixl_agent` (the
Python API's defaults) is measured the same way for comparison (host memory only).

`run_transfer_bench(...) -> dict` is the entry point (`tandem bench transfer --json`);
`python -m bench.transfer` prints the same JSON; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from importlib import metadata as package_metadata
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from bench.transfer_memory import MEMORIES, BenchPool, DeviceCopy, Memory, pool_pattern, require_cuda
from bench.transfer_raw import Op, RawNixl, stock_agent_idle_cpu
from connector.agent_types import KvAgentConfig
from connector.nixl_agent import KvAgent, load_nixl

HOLDER = "bench-holder"
READER = "bench-reader"
OPS: tuple[Op, ...] = ("READ", "WRITE")
GOAL_RATIO_VS_PREPPED = 0.9
GOAL_RATIO_VS_DEVICE_COPY = 0.5
GOAL_IDLE_CPU_PERCENT = 5.0
WRITE_SEED_OFFSET = 7919  # the caller's own pattern, pushed into the holder


def process_cpu_seconds() -> float:
    """CPU time of this process, all threads (NIXL's and UCX's included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def idle_cpu_percent(seconds: float) -> float:
    """Sleep for `seconds` and return the CPU this process used meanwhile, in % of a core."""
    cpu, wall = process_cpu_seconds(), time.perf_counter()
    time.sleep(seconds)
    return 100.0 * (process_cpu_seconds() - cpu) / (time.perf_counter() - wall)


def progress(line: str) -> None:
    print(f"bench transfer: {line}", file=sys.stderr, flush=True)


def _holder_main(conn: Connection, memory: Memory, num_blocks: int, block_nbytes: int, seed: int,
                 config: KvAgentConfig) -> None:
    """The holder: answers ("idle", seconds) with its CPU %, ("zero",) once its pool is zeroed,
    ("digest", ids) with the CRC-32 of those blocks, until "stop"."""
    pool = BenchPool(memory, num_blocks, block_nbytes)
    pool.fill(pool_pattern(num_blocks, block_nbytes, seed))
    with KvAgent(HOLDER, config) as agent:
        agent.register_pool(pool.buffer, block_nbytes)
        conn.send(agent.metadata())
        agent.add_peer(READER, conn.recv())
        while (command := conn.recv()) != "stop":
            kind, *args = command
            if kind == "idle":
                conn.send(idle_cpu_percent(*args))
            elif kind == "zero":
                conn.send(pool.zero())
            else:
                conn.send(pool.digest(*args))


def _receive(conn: Connection, seconds: float, what: str) -> Any:
    """The holder's next message; RuntimeError if it sends none within `seconds` or exits."""
    deadline = time.monotonic() + seconds
    while not conn.poll(0.5):
        holder = next((child for child in multiprocessing.active_children() if child.name == HOLDER), None)
        if holder is None or not holder.is_alive():
            raise RuntimeError(f"the holder process exited before sending {what} (its error is above)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the holder process sent no {what} within {seconds:.0f} s")
    return conn.recv()


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


class _Bench:
    """The caller's side of one run: its agent, pool and baselines, and the holder's pipe."""

    def __init__(self, agent: KvAgent, pool: BenchPool, conn: Connection, seed: int) -> None:
        self.agent, self.pool, self.conn = agent, pool, conn
        self.raw = RawNixl(agent, HOLDER)
        self.holder_pattern = pool_pattern(pool.num_blocks, pool.block_nbytes, seed)
        self.write_pattern = pool_pattern(pool.num_blocks, pool.block_nbytes, seed + WRITE_SEED_OFFSET)
        self.device_copy = (DeviceCopy(self.holder_pattern, pool.num_blocks, pool.block_nbytes)
                            if pool.memory == "vram" else None)

    def _ask(self, *command: Any) -> Any:
        self.conn.send(command)
        return _receive(self.conn, 60, f"an answer to {command[0]!r}")

    def _connector(self, op: Op, remote_ids: np.ndarray, local_ids: np.ndarray) -> dict[str, Callable[[], None]]:
        block = self.pool.block_nbytes
        remote_offsets, local_offsets = remote_ids * block, local_ids * block
        lengths = np.full(remote_ids.size, block, dtype=np.int64)
        blocks = self.agent.read_blocks if op == "READ" else self.agent.write_blocks
        ranges = self.agent.read_ranges if op == "READ" else self.agent.write_ranges
        self.descriptors = {"connector": 0, "connector_ranges": 0}

        def connector() -> None:
            result = blocks(HOLDER, remote_ids, local_ids, timeout_s=30.0)
            assert result.ok, result
            self.descriptors["connector"] = result.descriptors

        def connector_ranges() -> None:
            result = ranges(HOLDER, remote_offsets, local_offsets, lengths, timeout_s=30.0)
            assert result.ok, result
            self.descriptors["connector_ranges"] = result.descriptors

        return {"connector": connector, "connector_ranges": connector_ranges}

    def _verified(self, op: Op, variant: Callable[[], None], remote_ids: np.ndarray, local_ids: np.ndarray) -> bool:
        """The variant, once, moves the right bytes into blocks zeroed before it."""
        if op == "READ":
            self.pool.zero()
            variant()
            expected = self.holder_pattern.reshape(-1, self.pool.block_nbytes)[remote_ids]
            return self.pool.digest(local_ids) == zlib.crc32(np.ascontiguousarray(expected))
        self._ask("zero")
        variant()
        expected = self.write_pattern.reshape(-1, self.pool.block_nbytes)[local_ids]
        return self._ask("digest", remote_ids) == zlib.crc32(np.ascontiguousarray(expected))

    def measure(self, op: Op, remote_ids: np.ndarray, local_ids: np.ndarray, repeats: int) -> dict[str, Any]:
        variants = {
            **self._connector(op, remote_ids, local_ids),
            "raw_nixl": lambda: self.raw.transfer(op, remote_ids, local_ids),
            "raw_nixl_prepped": lambda: self.raw.transfer_prepped(op, remote_ids, local_ids),
        }
        verified = all(self._verified(op, variant, remote_ids, local_ids) for variant in variants.values())
        if self.device_copy is not None:
            copy = self.device_copy
            variants["device_copy"] = lambda: copy.copy(remote_ids, local_ids)
            verified &= copy.verified(remote_ids, local_ids)
        seconds = _timed_in_rotation(variants, repeats)
        return _layout_report(seconds, remote_ids.size, self.pool.block_nbytes, self.descriptors, verified)

    def close(self) -> None:
        self.raw.close()


def _layout_report(seconds: dict[str, list[float]], num_blocks: int, block_nbytes: int,
                   descriptors: dict[str, int], verified: bool) -> dict[str, Any]:
    nbytes = num_blocks * block_nbytes
    median = {name: statistics.median(values) for name, values in seconds.items()}

    def paired_ratio(baseline: str, variant: str = "connector") -> float:
        # Median of per-repetition ratios: each pair ran back to back, so load from other
        # processes that drifts over the run cancels out.
        return round(statistics.median(b / c for b, c in zip(seconds[baseline], seconds[variant])), 3)

    report = {
        **{f"{name}_gbps": round(nbytes / value / 1e9, 3) for name, value in median.items()},
        "ratio": paired_ratio("raw_nixl"),
        "ratio_vs_prepped": paired_ratio("raw_nixl_prepped"),
        "ranges_ratio_vs_prepped": paired_ratio("raw_nixl_prepped", "connector_ranges"),
        **{f"{name}_p50_ms": round(value * 1e3, 3) for name, value in median.items()},
        "connector_descriptors": descriptors["connector"],
        "connector_ranges_descriptors": descriptors["connector_ranges"],
        "raw_nixl_descriptors": num_blocks,
        "verified": verified,
    }
    if "device_copy" in seconds:
        report["ratio_vs_device_copy"] = paired_ratio("device_copy")
    return report


def _goals(memory: Memory, report: dict[str, Any]) -> dict[str, Any]:
    """The connector against raw NIXL prepped, each operation and layout; against the device
    copy for adjacent blocks (GPU memory); every variant's bytes right; a quiet idle agent."""
    layouts = [layout for op in OPS for layout in report.get(op.lower() + "s", {}).values()]
    met = all(layout["verified"] and layout["ratio_vs_prepped"] >= GOAL_RATIO_VS_PREPPED for layout in layouts)
    goals: dict[str, Any] = {"ratio_vs_prepped_min": GOAL_RATIO_VS_PREPPED,
                             "idle_cpu_percent_max": GOAL_IDLE_CPU_PERCENT}
    if memory == "vram":
        goals["ratio_vs_device_copy_min_adjacent"] = GOAL_RATIO_VS_DEVICE_COPY
        met &= all(report[op.lower() + "s"]["adjacent"]["ratio_vs_device_copy"] >= GOAL_RATIO_VS_DEVICE_COPY
                   for op in OPS if op.lower() + "s" in report)
    goals["met"] = bool(layouts) and met and report["idle_cpu_percent"] < GOAL_IDLE_CPU_PERCENT
    return goals


def run_transfer_bench(*, memory: Memory = "dram", num_blocks: int = 1024, block_nbytes: int = 16 * 1024,
                       repeats: int = 40, idle_seconds: float = 5.0, seed: int = 0, ops: tuple[Op, ...] = OPS,
                       compare_stock_agent: bool = True, config: KvAgentConfig | None = None) -> dict[str, Any]:
    if memory not in MEMORIES:
        raise ValueError(f"memory must be one of {MEMORIES}, not {memory!r}")
    if not ops or set(ops) - set(OPS):
        raise ValueError(f"ops must be some of {OPS}, not {ops!r}")
    # Host memory: CUDA-IPC reads do not apply, and where UCX has no CUDA transport it warns on
    # stdout about their variable, into the JSON. GPU memory: the agent's default (on).
    config = config or KvAgentConfig(cuda_ipc_reads=memory == "vram")
    if memory == "vram":
        require_cuda()  # here, before a holder process finds out alone
    context = multiprocessing.get_context("spawn")
    conn, holder_conn = context.Pipe()
    holder = context.Process(target=_holder_main, name=HOLDER, daemon=True,
                             args=(holder_conn, memory, num_blocks, block_nbytes, seed, config))
    holder.start()
    try:
        report = _run_against_holder(conn, memory, num_blocks, block_nbytes, repeats, idle_seconds, seed, ops,
                                     config)
    finally:
        holder.join(10)
        if holder.is_alive():
            holder.kill()
            holder.join()
    if compare_stock_agent and memory == "dram":
        report["idle_cpu_percent_stock_nixl_agent"] = round(stock_agent_idle_cpu(context, idle_seconds, idle_cpu_percent), 3)
    return {
        "bench": "transfer",
        "memory": memory,
        "nixl": _nixl_version(),
        "backends": list(config.backends),
        "progress_delay_us": config.progress_delay_us,
        "spin_us": config.spin_us,
        "cuda_ipc_reads": config.cuda_ipc_reads,
        "num_blocks": num_blocks,
        "block_nbytes": block_nbytes,
        "total_bytes": num_blocks * block_nbytes,
        "repeats": repeats,
        "idle_seconds": idle_seconds,
        **report,
        "goals": _goals(memory, report),
    }


def _run_against_holder(conn: Connection, memory: Memory, num_blocks: int, block_nbytes: int, repeats: int,
                        idle_seconds: float, seed: int, ops: tuple[Op, ...], config: KvAgentConfig) -> dict[str, Any]:
    """The caller's side, the holder process running: each operation and layout timed and
    verified, then both processes' CPU while idle with a registered pool and a connected peer;
    the holder is told to stop."""
    report: dict[str, Any] = {}
    holder_metadata = _receive(conn, 120, "its metadata")
    pool = BenchPool(memory, num_blocks, block_nbytes)
    rng = np.random.default_rng(seed + 1)
    layouts = {
        "adjacent": (np.arange(num_blocks), np.arange(num_blocks)),
        "scattered": (rng.permutation(num_blocks), rng.permutation(num_blocks)),
    }
    with KvAgent(READER, config) as agent:
        agent.register_pool(pool.buffer, block_nbytes)
        agent.add_peer(HOLDER, holder_metadata)
        conn.send(agent.metadata())
        bench = _Bench(agent, pool, conn, seed)
        try:
            for op in ops:
                if op == "WRITE":
                    pool.fill(bench.write_pattern)
                report[op.lower() + "s"] = {}
                for name, (remote, local) in layouts.items():
                    progress(f"{memory} {op} {name}: {num_blocks} blocks of {block_nbytes} bytes, {repeats} repeats")
                    report[op.lower() + "s"][name] = bench.measure(op, remote, local, repeats)
        finally:
            bench.close()
        # Both processes idle with a registered pool and a connected peer.
        reader_cpu = process_cpu_seconds()
        started = time.perf_counter()
        conn.send(("idle", idle_seconds))
        report["idle_cpu_percent"] = round(_receive(conn, idle_seconds + 30, "its idle CPU"), 3)
        report["idle_cpu_percent_reader"] = round(
            100.0 * (process_cpu_seconds() - reader_cpu) / (time.perf_counter() - started), 3)
    conn.send("stop")
    return report


def _nixl_version() -> str:
    package = load_nixl().__name__.split(".", 1)[0].replace("_", "-")
    try:
        return f"{package} {package_metadata.version(package)}"
    except package_metadata.PackageNotFoundError:
        return package


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", choices=MEMORIES, default="dram",
                        help="where both pools live: host memory, or GPU memory (torch CUDA tensors)")
    parser.add_argument("--blocks", type=int, default=1024)
    parser.add_argument("--block-bytes", type=int, default=16 * 1024)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--ops", default="READ,WRITE", help="READ (pull), WRITE (push) or both, comma-separated")
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    parser.add_argument("--progress-delay-us", type=int, default=KvAgentConfig().progress_delay_us)
    parser.add_argument("--no-stock", action="store_true", help="skip the stock nixl_agent idle CPU comparison")
    parser.add_argument("--json", action="store_true", help="one JSON object (the default output anyway)")
    args = parser.parse_args(argv)
    ops = tuple(op.strip().upper() for op in args.ops.split(",") if op.strip())
    config = KvAgentConfig(progress_delay_us=args.progress_delay_us, cuda_ipc_reads=args.memory == "vram")
    report = run_transfer_bench(memory=args.memory, num_blocks=args.blocks, block_nbytes=args.block_bytes,
                                repeats=args.repeats, idle_seconds=args.idle_seconds, ops=ops,  # type: ignore[arg-type]
                                compare_stock_agent=not args.no_stock, config=config)
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
