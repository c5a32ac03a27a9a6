"""Router replicas side by side: one router against N routers on the same port (SO_REUSEPORT,
predicted load shared over NATS), on a local sim stack.

- `start_replicas(routers, ...)`: a local stack (embedded NATS, orchestrator, metrics
  collector, sim workers of role both, `routers` router processes on one port) and its
  base URL; `ReplicaStack.stop()` stops it. Sim workers run at `--sim-speedup 1000` unless
  told otherwise: the engines cost next to nothing and the routers are what is measured.
- `measure_throughput(...)`: requests/s of short completions through 1 router and through
  N, in alternation and over rounds; the client runs in separate processes (closed loop,
  keep-alive connections, which the kernel spreads over the routers when they connect).
- `measure_tenants(...)`: routing quality with N routers against 1: the `tandem bench
  routing` tenants workload and its driver (`bench.routing.drive.run_tenants`), the same
  seeded arrivals for both, P90 TTFT side by side.

`python -m bench.router.replicas [--quick] [--what throughput,tenants]` prints one JSON
document; progress goes to stderr. Not a test. On a machine with few cores the client, the
engines, NATS and every router share them: the document says how many there were.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from bench.options import add_model_dir
from bench.routing.client import progress
from bench.routing.drive import Run, run_tenants
from bench.routing.systems import cpu_seconds
from bench.routing.workloads import EngineShape, TenantsWorkload
from launch.definition import HttpService, Membership, Settings, StackDefinition, WorkerGroup
from launch.plan import plan_stack
from launch.stack import LocalStack, router_names
from services.worker.sim.profile import load_profile
from shared.schemas import WorkerRole

NEAR_ZERO_SPEEDUP = 1000.0


# ---- a stack with N routers --------------------------------------------------------------------


@dataclass
class ReplicaStack:
    base_url: str  # the routers' one address (an OpenAI-compatible API under /v1)
    metrics_url: str  # the metrics collector
    stack: LocalStack

    @property
    def router_pids(self) -> list[int]:
        return [process.pid for name, process in self.stack.processes.items()
                if name in router_names(self.stack.config.routers)]

    @property
    def pids(self) -> list[int]:
        pids = [process.pid for process in self.stack.processes.values()]
        if self.stack.nats is not None and self.stack.nats.process is not None:
            pids.append(self.stack.nats.process.pid)
        return pids

    def stop(self) -> None:
        self.stack.stop()


def start_replicas(routers: int, *, model_dir: str, log_dir: str | Path, workers: int = 2,
                   sim_speedup: float = NEAR_ZERO_SPEEDUP, worker_settings: Settings | None = None,
                   router_settings: Settings | None = None) -> ReplicaStack:
    """A running sim stack with `routers` routers on one port (free ports everywhere)."""
    shutil.rmtree(log_dir, ignore_errors=True)
    group = WorkerGroup(name="worker", role=WorkerRole.BOTH, count=workers, engine="sim",
                        settings={**(worker_settings or {}), "sim_speedup": sim_speedup})
    definition = StackDefinition(name=f"replicas-{routers}", model_dir=model_dir, workers=(group,), routers=routers,
                                 membership=Membership(heartbeat_interval_s=0.5, ttl_s=5.0),
                                 router=HttpService(port=0, health="/health", settings=router_settings or {}),
                                 metrics=HttpService(port=0, health="/metrics"))
    stack = LocalStack(plan_stack(definition, log_dir=str(log_dir)))
    stack.start()  # stops what it started if it fails
    return ReplicaStack(base_url=stack.router_url, metrics_url=stack.metrics_url, stack=stack)


@contextmanager
def replicas(routers: int, **options) -> Iterator[ReplicaStack]:
    running = start_replicas(routers, **options)
    try:
        yield running
    finally:
        running.stop()


def _served_model(base_url: str) -> str:
    return httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]


# ---- requests/s: a closed-loop client in separate processes ------------------------------------


async def _closed_loop(base_url: str, model: str, lanes: int, duration_s: float, max_tokens: int,
                       lane_offset: int) -> tuple[int, int]:
    """(answers, errors) of `lanes` lanes each sending one request after the other."""
    limits = httpx.Limits(max_connections=lanes, max_keepalive_connections=lanes)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=30.0) as client:
        deadline = time.monotonic() + duration_s

        async def lane(number: int) -> tuple[int, int]:
            answers = errors = 0
            while time.monotonic() < deadline:
                body = {"model": model, "prompt": f"lane {number} request {answers + errors}",
                        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
                try:
                    response = await client.post("/v1/completions", json=body)
                    ok = response.status_code == 200
                except httpx.HTTPError:
                    ok = False
                answers, errors = answers + ok, errors + (not ok)
            return answers, errors

        results = await asyncio.gather(*(lane(lane_offset + number) for number in range(lanes)))
    return sum(answers for answers, _ in results), sum(errors for _, errors in results)


def _client_process(base_url: str, model: str, lanes: int, duration_s: float, max_tokens: int,
                    lane_offset: int) -> tuple[int, int]:
    return asyncio.run(_closed_loop(base_url, model, lanes, duration_s, max_tokens, lane_offset))


def drive_closed_loop(base_url: str, *, concurrency: int, duration_s: float, client_processes: int,
                      max_tokens: int = 2) -> dict:
    model = _served_model(base_url)
    lanes = [concurrency // client_processes + (index < concurrency % client_processes)
             for index in range(client_processes)]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=client_processes, mp_context=context) as pool:
        # a short warm-up (connections, tokenizer caches), then the measured window
        warmup = list(pool.map(_client_process, [base_url] * client_processes, [model] * client_processes, lanes,
                      [min(1.0, duration_s)] * client_processes, [max_tokens] * client_processes,
                      [sum(lanes[:index]) for index in range(client_processes)]))
        started = time.monotonic()
        results = list(pool.map(_client_process, [base_url] * client_processes, [model] * client_processes, lanes,
                                [duration_s] * client_processes, [max_tokens] * client_processes,
                                [10_000 + sum(lanes[:index]) for index in range(client_processes)]))
        elapsed = time.monotonic() - started
    answers, errors = sum(answers for answers, _ in results), sum(errors for _, errors in results)
    return {"requests_per_s": round(answers / elapsed, 1), "answers": answers, "errors": errors,
            "wall_s": round(elapsed, 2), "warmup_answers": sum(answers for answers, _ in warmup)}


def measure_throughput(router_counts: Sequence[int] = (1, 2), *, model_dir: str, log_root: Path, rounds: int = 2,
                       workers: int = 2, concurrency: int = 32, duration_s: float = 10.0,
                       client_processes: int = 2) -> dict:
    """Requests/s through each router count, alternated within every round; each count's
    figure over the first's (median and spread over rounds)."""
    rows = []
    for round_number in range(rounds):
        for routers in router_counts:
            progress(f"throughput round {round_number + 1}: {routers} router(s), {workers} workers at "
                     f"speed-up {NEAR_ZERO_SPEEDUP:g}, concurrency {concurrency}")
            with replicas(routers, model_dir=model_dir, log_dir=log_root / f"throughput-{routers}",
                          workers=workers) as running:
                pids, routers_pids = running.pids, running.router_pids
                cpu_before, wall_before = cpu_seconds(pids), time.monotonic()
                router_cpu_before = _cpu_of(routers_pids)
                figures = drive_closed_loop(running.base_url, concurrency=concurrency, duration_s=duration_s,
                                            client_processes=client_processes)
                figures["stack_cpu_busy"] = round((cpu_seconds(pids) - cpu_before)
                                                  / ((time.monotonic() - wall_before) * (os.cpu_count() or 1)), 2)
                # CPU the routers spent per answer (warm-up included in the answers' window only
                # roughly): what N routers cost beside one, whatever else the machine runs
                answered = figures["answers"] + figures["warmup_answers"]
                figures["router_cpu_ms_per_request"] = (
                    round(1000 * (_cpu_of(routers_pids) - router_cpu_before) / answered, 2) if answered else None)
            progress(f"  -> {json.dumps(figures)}")
            rows.append({"round": round_number + 1, "routers": routers, **figures})
    return {"rows": rows, "ratio_vs_first": _ratios(rows, router_counts, "requests_per_s")}


# ---- routing quality: the tenants workload of `tandem bench routing` ---------------------------


def measure_tenants(router_counts: Sequence[int] = (1, 2), *, model_dir: str, log_root: Path, rounds: int = 1,
                    workers: int = 4, duration_s: float = 8.0, drain_s: float = 30.0, sim_speedup: float = 0.25,
                    seed: int = 0, workload: TenantsWorkload | None = None) -> dict:
    """P90 TTFT (and the rest of the routing bench's row) with each router count, the same
    seeded arrivals for each, alternated within every round."""
    from shared.tokenizer import Tokenizer

    shape = EngineShape(workers=workers, block_size=16, max_num_batched_tokens=512, max_model_len=2048,
                        profile=load_profile(""), sim_speedup=sim_speedup)
    workload = workload or TenantsWorkload(tenants=2 * workers)
    worker_settings: Settings = {"block_size": shape.block_size, "max_num_batched_tokens": shape.max_num_batched_tokens,
                                 "max_model_len": shape.max_model_len, "kv_blocks": workload.kv_blocks(shape)}
    vocab_size = Tokenizer.from_model_dir(model_dir).vocab_size
    rate = workload.rate_rps(shape)
    rows = []
    for round_number in range(rounds):
        for routers in router_counts:
            progress(f"tenants round {round_number + 1}: {routers} router(s), {workers} workers, "
                     f"{rate:.1f} req/s for {duration_s:g}s")
            with replicas(routers, model_dir=model_dir, log_dir=log_root / f"tenants-{routers}", workers=workers,
                          sim_speedup=sim_speedup, worker_settings=worker_settings,
                          router_settings={"routing_policy": "kv-aware"}) as running:
                run = Run(router_url=running.base_url, metrics_url=running.metrics_url,
                          model=_served_model(running.base_url), model_dir=model_dir, vocab_size=vocab_size,
                          seed=seed, duration_s=duration_s, drain_s=drain_s, rate_rps=rate)
                pids = running.pids
                cpu_before, wall_before = cpu_seconds(pids), time.monotonic()
                figures = asyncio.run(run_tenants(run, workload, concurrency=workers))
                figures["cpu_busy"] = round((cpu_seconds(pids) - cpu_before)
                                            / ((time.monotonic() - wall_before) * (os.cpu_count() or 1)), 2)
            progress(f"  -> {json.dumps(figures)}")
            rows.append({"round": round_number + 1, "routers": routers, **figures})
    return {"workload": asdict(workload), "offered_rps": round(rate, 2), "rows": rows,
            "ttft_p90_ratio_vs_first": _ratios(rows, router_counts, "ttft_p90_ms")}


def _cpu_of(pids: list[int]) -> float:
    """CPU seconds used so far by `pids` only (Linux /proc)."""
    return cpu_seconds(pids) - sum(os.times()[:2])


def _ratios(rows: list[dict], router_counts: Sequence[int], figure: str) -> dict[str, dict]:
    """Per router count after the first: its figure over the first's, round by round; the
    median and the spread (min, max)."""
    first = router_counts[0]
    by_round: dict[int, dict[int, float]] = {}
    for row in rows:
        if row.get(figure):
            by_round.setdefault(row["round"], {})[row["routers"]] = row[figure]
    ratios = {}
    for routers in router_counts[1:]:
        values = [figures[routers] / figures[first] for figures in by_round.values()
                  if figures.get(first) and figures.get(routers)]
        ratios[str(routers)] = ({"median": round(statistics.median(values), 3), "min": round(min(values), 3),
                                 "max": round(max(values), 3)} if values else None)
    return ratios


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.router.replicas", description=__doc__.splitlines()[0])
    parser.add_argument("--routers", type=int, default=2, help="compared with one router")
    parser.add_argument("--what", default="throughput,tenants")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--client-processes", type=int, default=2)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per measured run")
    parser.add_argument("--tenant-workers", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="one round, 5 s runs")
    add_model_dir(parser)
    parser.add_argument("--state-dir", default=".tandem/bench-replicas")
    args = parser.parse_args(argv)
    what = {name.strip() for name in args.what.split(",") if name.strip()}
    rounds, duration_s = (1, 5.0) if args.quick else (args.rounds, args.duration)
    from shared.tiny_model import model_dir_or_tiny

    state_dir = Path(args.state_dir)
    model_dir = model_dir_or_tiny(args.model_dir, state_dir)
    counts = (1, args.routers)
    document: dict = {"bench": "router-replicas", "cpus": os.cpu_count(), "routers": counts, "rounds": rounds}
    if "throughput" in what:
        document["throughput"] = measure_throughput(counts, model_dir=model_dir, log_root=state_dir / "logs",
                                                    rounds=rounds, concurrency=args.concurrency,
                                                    duration_s=duration_s, client_processes=args.client_processes)
    if "tenants" in what:
        document["tenants"] = measure_tenants(counts, model_dir=model_dir, log_root=state_dir / "logs",
                                              rounds=rounds, workers=args.tenant_workers, duration_s=duration_s)
    json.dump(document, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
