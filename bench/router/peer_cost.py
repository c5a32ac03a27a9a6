"""What a router pays for the requests another router serves: a stack of 2 routers (or 1,
`--routers 1`: the baseline) before 2 sim workers at 1000x, only the first router driven,
through its own port (`LocalStack.router_instance_urls`), 32 requests in flight of 8 tokens;
each router's CPU per driven request (from `/proc`), and the bus messages a router follows
per driven request, counted by a subscriber of the namespace (KV events, load reports, the
routers' shared loads; request records too, which routers do not read).

    python -m bench.router.peer_cost [--requests 4000] [--routers 2]
"""

from __future__ import annotations

import argparse
import asyncio
import uuid
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import nats

from bench.router.load import Phase, process_cpu_s, run_phase
from bench.router.systems import RouterSystem, _served_model
from launch.plan import StackConfig, WorkerSpec
from launch.stack import LocalStack, router_names
from shared.tiny_model import model_dir_or_tiny

FOLLOWED = {"kv": "kv.events.*", "load": "load.*", "router_load": "router.load.*", "records": "requests.events"}


async def _drive(stack: LocalStack, driven: RouterSystem, namespace: str, requests: int) -> tuple[Counter, dict]:
    counts: Counter[str] = Counter()
    client = await nats.connect(stack.nats_url)
    for kind, subject in FOLLOWED.items():
        async def count(_msg, kind: str = kind) -> None:
            counts[kind] += 1
        await client.subscribe(f"{namespace}.*.{subject}", cb=count)
    pids = dict(zip(router_names(stack.config.routers), _router_pids(stack)))
    before = {name: process_cpu_s(pid) for name, pid in pids.items()}
    await run_phase(driven, Phase("concurrent", requests, 32, 8))
    spent = {name: process_cpu_s(pid) - before[name] for name, pid in pids.items()}
    await client.drain()
    return counts, spent


def _router_pids(stack: LocalStack) -> list[int]:
    return [stack.processes[name].pid for name in router_names(stack.config.routers)]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--routers", type=int, default=2)
    args = parser.parse_args(argv)
    state = Path(".tandem/bench-router")
    model_dir = model_dir_or_tiny(None, state)
    settings = {"sim_speedup": 1000.0, "kv_blocks": 512}
    namespace = "peercost" + uuid.uuid4().hex[:8]
    config = StackConfig(model_dir=model_dir, engine="sim", router_port=0, metrics_port=0, namespace=namespace,
                         workers=tuple(WorkerSpec(worker_id=f"w{index + 1}", settings=settings) for index in range(2)),
                         log_dir=str(state / "logs-peer-cost"), routers=args.routers)
    stack = LocalStack(config)
    stack.start()
    try:
        url = stack.router_instance_urls.get("router", stack.router_url)
        driven = RouterSystem("driven", (url,), _served_model(url), (_router_pids(stack)[0],))
        asyncio.run(run_phase(driven, Phase("warmup", 200, 32, 8)))
        counts, spent = asyncio.run(_drive(stack, driven, namespace, args.requests))
    finally:
        stack.stop()
    for name, cpu_s in spent.items():
        print(f"{name}: {cpu_s * 1e6 / args.requests:.0f} CPU-us per driven request")
    print("per driven request: " + ", ".join(f"{kind} {counts[kind] / args.requests:.2f}" for kind in FOLLOWED))


if __name__ == "__main__":
    main()
