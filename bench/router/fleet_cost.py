"""What routers cost before any request, as the fleet grows: each router's CPU per second at
zero load (following the workers' heartbeats, load snapshots and KV events, and its peers'
shared load), beside the metrics collector's and the orchestrator's, for 1, 2 and 4 routers
on one port and fleets of 16, 256 and 1024 simulated workers (`tandem worker-fleet`).

Then the projection: N routers, each on a core of its own, serve

    requests/s = N * (1 - background) / summed CPU per request

where `background` is one router's CPU per second at zero load (cores) measured here and
"summed CPU per request" is all N routers' CPU over the requests they served together, from
`tandem bench router --routers 1,2,4` (`--router-bench FILE`: its JSON; without it, no
projection). The model leaves out the client, NATS and the engines, which have cores of
their own in a real fleet.

    python -m bench.router.fleet_cost [--fleets 16,256,1024] [--routers 1,2,4] [--window 10]
        [--windows 2] [--router-bench FILE] [--out FILE]

Prints one JSON document on stdout, progress on stderr. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from bench.options import add_model_dir
from bench.router.load import process_cpu_s
from launch.plan import StackConfig
from launch.service_commands import CLUSTER_FIELDS, WORKER_COMMAND, cluster_bus, cluster_membership
from launch.stack import LocalStack, router_names
from shared.bus import connect
from shared.config import WorkerConfig
from shared.subjects import Subjects
from shared.tiny_model import generate_tiny_model

HEARTBEAT_S = 1.0  # the scale test's settings: what a cluster this size would run (docs/scale.md)
LOAD_INTERVAL_S = 1.0
TTL_S = 10.0
REGISTER_TIMEOUT_S = 120.0


def progress(message: str) -> None:
    print(f"fleet_cost: {message}", file=sys.stderr, flush=True)


def fleet_stack(model_dir: str, log_dir: Path, routers: int) -> LocalStack:
    return LocalStack(StackConfig(
        model_dir=model_dir, workers=(), router_port=0, metrics_port=0, routers=routers,
        namespace="cost" + uuid.uuid4().hex[:10], heartbeat_interval_s=HEARTBEAT_S, ttl_s=TTL_S,
        log_dir=str(log_dir), start_timeout_s=60.0))


def fleet_args(stack: LocalStack, count: int) -> list[str]:
    """`tandem worker-fleet` of `count` sim workers on the stack's bus; its worker flags written
    from a worker config, as the launchers write theirs (`launch.service_commands`)."""
    config = stack.config
    worker = WorkerConfig(worker_id="template", engine="sim", model_dir=config.model_dir, kv_blocks=256,
                          load_interval_s=LOAD_INTERVAL_S, bus=cluster_bus(stack.nats_url, config.namespace),
                          membership=cluster_membership(HEARTBEAT_S, TTL_S))
    return ["worker-fleet", "--count", str(count), "--id-prefix", "sim-",
            *WORKER_COMMAND.flags(worker, ("engine", "model_dir", *CLUSTER_FIELDS, "load_interval_s", "kv_blocks"))]


def router_urls(stack: LocalStack) -> dict[str, str]:
    """Each router's own address (replicas answer on a port of their own)."""
    return {name: stack.router_instance_urls.get(name, stack.router_url)
            for name in router_names(stack.config.routers)}


def wait_all_registered(stack: LocalStack, count: int, fleet_alive) -> float:
    """Until every router lists `count` workers; the seconds it took."""
    started = time.monotonic()
    with httpx.Client(timeout=5.0) as http:
        while True:
            if not fleet_alive():
                raise RuntimeError("the worker fleet exited before registering")
            seen = [http.get(url + "/health").json()["worker_count"] for url in router_urls(stack).values()]
            if all(number == count for number in seen):
                return time.monotonic() - started
            if time.monotonic() - started > REGISTER_TIMEOUT_S:
                raise TimeoutError(f"{count} workers not registered at every router within "
                                   f"{REGISTER_TIMEOUT_S:g} s (seen: {seen})")
            time.sleep(0.2)


async def _window(nats_url: str, namespace: str, pids: Mapping[str, int], window_s: float) -> dict:
    """Each process's CPU seconds per second (cores) over one window of `window_s`, and the
    heartbeats, load snapshots and routers' shared loads a second published meanwhile (what
    the fleet actually delivered: a starved fleet sends fewer than it should)."""
    subjects = Subjects(namespace)
    heard: Counter[str] = Counter()
    streams = {f"$KV.{subjects.members_bucket}.>": "heartbeats", subjects.load_all: "load_snapshots",
               subjects.router_load_all: "router_shared_loads"}
    async with await connect(nats_url, "fleet-cost") as bus:
        for subject, kind in streams.items():
            async def count(_msg, kind: str = kind) -> None:
                heard[kind] += 1
            await bus.client.subscribe(subject, cb=count)
        await bus.client.flush()
        before = {name: process_cpu_s(pid) for name, pid in pids.items()}
        started = time.monotonic()
        await asyncio.sleep(window_s)  # the measurement window itself
        elapsed = time.monotonic() - started
        cores = {name: round((process_cpu_s(pid) - before[name]) / elapsed, 4) for name, pid in pids.items()}
    return {"cores": cores, "messages_per_s": {kind: round(heard[kind] / elapsed) for kind in streams.values()}}


def measure(model_dir: str, state: Path, fleet: int, routers: int, window_s: float, windows: int) -> dict:
    """One stack of `routers` routers before a fleet of `fleet` workers, idle: CPU per second of
    every process over `windows` windows."""
    stack = fleet_stack(model_dir, state / f"logs-{fleet}-{routers}", routers)
    stack.start()
    try:
        started = stack.launcher.start("fleet", fleet_args(stack, fleet))
        registered_s = wait_all_registered(stack, fleet, lambda: started.alive)
        time.sleep(2 * HEARTBEAT_S)  # past the registrations' own burst
        names = [*router_names(routers), "metrics", "orchestrator", "fleet"]
        pids = {name: stack.processes[name].pid for name in names}
        windows_seen = [asyncio.run(_window(stack.nats_url, stack.config.namespace, pids, window_s))
                        for _ in range(windows)]
    finally:
        stack.stop()
    samples = [window["cores"] for window in windows_seen]
    per_router = [sample[name] for sample in samples for name in router_names(routers)]
    return {
        "fleet": fleet, "routers": routers, "registered_s": round(registered_s, 2),
        "windows": windows_seen,
        "load_snapshots_per_s_median": statistics.median(w["messages_per_s"]["load_snapshots"] for w in windows_seen),
        "router_cores_per_router_median": round(statistics.median(per_router), 4),
        "router_cores_per_router_max": round(max(per_router), 4),
        "router_cores_summed_median": round(statistics.median(
            [sum(sample[name] for name in router_names(routers)) for sample in samples]), 4),
        "collector_cores_median": round(statistics.median(sample["metrics"] for sample in samples), 4),
        "orchestrator_cores_median": round(statistics.median(sample["orchestrator"] for sample in samples), 4),
    }


def summed_cpu_per_request_us(router_bench: Mapping) -> dict[int, float]:
    """From `tandem bench router`'s JSON: the median summed router CPU-µs per request of the
    concurrent phase, by router count."""
    costs: dict[int, float] = {}
    for system, figures in router_bench.get("systems", {}).items():
        if system == "tandem":
            routers = 1
        elif system.startswith("tandem-") and system.endswith("-routers"):
            routers = int(system.split("-")[1])
        else:
            continue
        median = figures.get("concurrent", {}).get("router_cpu_us_per_request", {}).get("median")
        if median:
            costs[routers] = float(median)
    return costs


def projection(background_cores: float, routers: int, cpu_per_request_us: float) -> float:
    """Requests/s of `routers` routers on a core each: what their cores have left after the
    background, over the summed CPU per request."""
    return routers * max(0.0, 1.0 - background_cores) / (cpu_per_request_us * 1e-6)


def projections(runs: Sequence[dict], costs: Mapping[int, float]) -> list[dict]:
    return [{"fleet": run["fleet"], "routers": run["routers"],
             "background_cores_per_router": run["router_cores_per_router_median"],
             "summed_cpu_us_per_request": costs[run["routers"]],
             "requests_per_s": round(projection(run["router_cores_per_router_median"], run["routers"],
                                                costs[run["routers"]]))}
            for run in runs if run["routers"] in costs]


def counts(text: str, flag: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"{flag} takes comma-separated whole numbers, not {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"{flag} takes positive whole numbers, not {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fleets", default="16,256,1024", help="fleet sizes (simulated workers)")
    parser.add_argument("--routers", default="1,2,4", help="router counts on one port")
    parser.add_argument("--window", type=float, default=10.0, help="seconds per measurement window")
    parser.add_argument("--windows", type=int, default=2, help="windows per stack")
    parser.add_argument("--router-bench", help="`tandem bench router --routers ...` JSON, for the projection")
    add_model_dir(parser, default=None)
    parser.add_argument("--out", help="also write the JSON document to this file")
    args = parser.parse_args(argv)
    fleets, router_counts = counts(args.fleets, "--fleets"), counts(args.routers, "--routers")
    if args.window <= 0 or args.windows < 1:
        parser.error("--window must be positive and --windows at least 1")
    state = Path(tempfile.mkdtemp(prefix="tandem-fleet-cost-"))
    model_dir = args.model_dir or str(state / "tiny")
    if not args.model_dir:
        generate_tiny_model(model_dir)
    runs = []
    for fleet in fleets:
        for routers in router_counts:
            progress(f"fleet {fleet}, {routers} router(s): starting")
            run = measure(model_dir, state, fleet, routers, args.window, args.windows)
            progress(f"fleet {fleet}, {routers} router(s): {run['router_cores_per_router_median']} cores per router, "
                     f"collector {run['collector_cores_median']}")
            runs.append(run)
    document: dict = {
        "command": "python -m bench.router.fleet_cost " + " ".join(sys.argv[1:] if argv is None else argv),
        "config": {"heartbeat_s": HEARTBEAT_S, "load_interval_s": LOAD_INTERVAL_S, "window_s": args.window,
                   "windows": args.windows},
        "runs": runs,
    }
    if args.router_bench:
        costs = summed_cpu_per_request_us(json.loads(Path(args.router_bench).read_text()))
        document["projection"] = {"model": "requests/s = N * (1 - background cores per router) / summed CPU per "
                                           "request (N routers, a core each)",
                                  "router_bench": args.router_bench, "rows": projections(runs, costs)}
    text = json.dumps(document, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
