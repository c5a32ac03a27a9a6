"""Routing benchmark: KV-aware routing beside round-robin and random, on a real local stack.

For each workload (`bench.routing.workloads`: "tenants", "multi-turn") and each policy, in
alternation, a fresh stack starts from a stack definition (`launch`: embedded
NATS, orchestrator, metrics collector, sim workers of role `both`, router), so no cache
carries over from one policy to the next. The sim workers get a KV pool small enough that
the workload's live prefixes fill `--kv-fill` of the cluster, and arrivals come at `--load`
times what the cluster could serve with no cache at all (both derived from the timing
profile). Every policy sees the same seeded arrivals and prompts.

A light client (httpx, one event loop) streams `/v1/completions` with token-id prompts:
TTFT is the time from sending to the first non-empty text chunk; throughput is completion
tokens over the time from the first send to the last answer. The hit rate is cached /
prompt tokens over the run, from the workers' load snapshots (the metrics collector's
`/cluster`); prompt tokens a worker pulled from another worker's cache count as cached
there (`pull_rate` says how many of them were pulled). Requests that fail, or are still
running `--drain` seconds after the last arrival, are errors.

The policy reaches the router as `--routing-policy NAME`: kv-aware is the cost model, the
baselines replace only the choice of worker (prefix pulls still happen).

    tandem bench routing [--quick] [--workers 8] [--duration 20] [--policies kv-aware,round-robin,random]
    tandem bench routing --sweep [--quick] [--points ...] [--arms ...]   (see `bench.routing.sweep`)

prints one JSON document (`{"config", "policies", "results": [rows], "p90_ratio_vs_kv_aware"}`)
on stdout, progress on stderr. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.options import add_model_dir
from bench.routing.client import progress
from bench.routing.drive import Run, run_conversations, run_tenants
from bench.routing.fleet_shapes import parse_shapes, worker_groups
from bench.routing.systems import cpu_seconds
from bench.routing.workloads import ConversationsWorkload, EngineShape, TenantsWorkload
from launch.definition import HttpService, Membership, Settings, StackDefinition
from launch.plan import plan_stack
from launch.stack import LocalStack
from services.worker.sim.profile import load_profile

POLICIES = ("kv-aware", "round-robin", "random")
WORKLOADS = ("tenants", "multi-turn")


# ---- how the policy reaches the router -------------------------------------------------------


@dataclass(frozen=True)
class RouterPlan:
    """How one policy is run: the router's settings for it."""

    router_settings: Settings
    impl: str


def router_plan(policy: str) -> RouterPlan:
    return RouterPlan(router_settings={"routing_policy": policy}, impl=f"router --routing-policy {policy}")


# ---- one stack per (workload, policy) ---------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    shape: EngineShape
    model_dir: str
    log_root: Path
    worker_settings: Settings  # `tandem worker` options besides kv_blocks
    seed: int
    duration_s: float
    drain_s: float


def _served_model(router_url: str) -> str:
    return httpx.get(f"{router_url}/v1/models", timeout=10).json()["data"][0]["id"]


def run_one(setup: Setup, workload_name: str, workload: TenantsWorkload | ConversationsWorkload,
            policy: str, plan: RouterPlan) -> dict:
    shape = setup.shape
    kv_blocks = workload.kv_blocks(shape)
    rate = workload.rate_rps(shape)
    log_dir = setup.log_root / f"{workload_name}-{policy}"
    shutil.rmtree(log_dir, ignore_errors=True)
    workers = worker_groups(shape.workers, shape.mix, engine="sim", block_size=shape.block_size, kv_blocks=kv_blocks,
                            settings={**setup.worker_settings, "sim_speedup": shape.sim_speedup})
    definition = StackDefinition(name=f"{workload_name}-{policy}", model_dir=setup.model_dir, workers=workers,
                                 membership=Membership(heartbeat_interval_s=0.5, ttl_s=5.0),
                                 router=HttpService(port=0, health="/health", settings=plan.router_settings),
                                 metrics=HttpService(port=0, health="/metrics"))
    offered = (f"{rate:.1f} req/s" if isinstance(workload, TenantsWorkload)
               else f"{workload.users(shape)} users, ~{rate:.1f} turns/s")
    progress(f"{workload_name} / {policy}: {shape.workers} workers x {kv_blocks} KV blocks, "
             f"{offered} for {setup.duration_s:g}s ({plan.impl})")
    stack = LocalStack(plan_stack(definition, log_dir=str(log_dir)))
    try:
        stack.start()
    except (RuntimeError, TimeoutError) as error:  # the row says so; the other rows still run
        progress(f"  the stack did not start: {error}")
        return {"workload": workload_name, "policy": policy, "error": f"stack did not start: {error}"[:500],
                "router_policy": plan.impl}
    try:
        from shared.tokenizer import Tokenizer

        run = Run(router_url=stack.router_url, metrics_url=stack.metrics_url, model=_served_model(stack.router_url),
                  model_dir=setup.model_dir, vocab_size=Tokenizer.from_model_dir(setup.model_dir).vocab_size,
                  seed=setup.seed, duration_s=setup.duration_s, drain_s=setup.drain_s, rate_rps=rate)
        pids = [process.pid for process in stack.processes.values()]
        if stack.nats is not None and stack.nats.process is not None:
            pids.append(stack.nats.process.pid)
        cpu_before, wall_before = cpu_seconds(pids), time.monotonic()
        if isinstance(workload, TenantsWorkload):
            figures = asyncio.run(run_tenants(run, workload, concurrency=shape.workers))
        else:
            figures = asyncio.run(run_conversations(run, workload, shape))
        # a machine short of CPU inflates every policy's TTFT: the row shows how busy it was
        figures["cpu_busy"] = round((cpu_seconds(pids) - cpu_before)
                                    / ((time.monotonic() - wall_before) * (os.cpu_count() or 1)), 2)
    finally:
        stack.stop()
    row = {"workload": workload_name, "policy": policy, **figures, "offered_rps": round(rate, 2),
           "kv_blocks_per_worker": kv_blocks, "router_policy": plan.impl}
    progress(f"  -> {json.dumps(figures)}")
    return row


def p90_ratios(rows: list[dict]) -> dict[str, dict[str, float | None]]:
    """Per workload: each policy's P90 TTFT over kv-aware's (above 1: kv-aware is better)."""
    ratios: dict[str, dict[str, float | None]] = {}
    for workload in dict.fromkeys(row["workload"] for row in rows):
        base = next((row.get("ttft_p90_ms") for row in rows
                     if row["workload"] == workload and row["policy"] == "kv-aware"), None)
        if not base:
            continue
        ratios[workload] = {row["policy"]: (round(row["ttft_p90_ms"] / base, 2) if row.get("ttft_p90_ms") else None)
                            for row in rows if row["workload"] == workload and row["policy"] != "kv-aware"}
    return ratios


def parse_names(value: str, allowed: Sequence[str], what: str) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in allowed]
    if unknown or not names:
        raise SystemExit(f"bench_routing: unknown {what} {unknown}; choose from {', '.join(allowed)}")
    return names


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem bench routing", description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8, help="sim workers of role both")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per policy")
    parser.add_argument("--drain", type=float, default=30.0,
                        help="seconds to wait for answers after the last arrival; later ones are errors")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--load", type=float, default=None,
                        help="offered rate / cluster capacity with no cache (default: per workload)")
    parser.add_argument("--kv-fill", type=float, default=0.7,
                        help="share of the cluster's KV the live prefixes need")
    parser.add_argument("--tenants", type=int, default=0, help="default: 2 per worker")
    parser.add_argument("--prefix-tokens", type=int, default=1536)
    parser.add_argument("--query-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16, help="answer length (tenants)")
    parser.add_argument("--turns", type=int, default=6, help="turns per conversation (multi-turn)")
    parser.add_argument("--sim-speedup", type=float, default=0.25,
                        help="sim speed-up; keeps the offered rate within what this machine's CPUs can drive")
    parser.add_argument("--sim-profile", default="", help="timing profile JSON (default: the packaged one)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--no-kv-transfer", action="store_true",
                        help="workers without the KV data plane: no prefix pull between workers")
    add_model_dir(parser)
    parser.add_argument("--state-dir", default=".tandem/bench-routing", help="logs and the generated model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shapes", default="", help="the workers' shapes in turn, e.g. tp1,tp2-bs32,pp2 "
                                                      "(default: all alike)")
    parser.add_argument("--quick", action="store_true", help="a short run: 8 s of arrivals per policy")
    parser.add_argument("--json", action="store_true", help="accepted; stdout is always one JSON document")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--sweep" in argv:  # the workload family against an oracle: its own flags
        from bench.routing.sweep import main as sweep_main

        return sweep_main([arg for arg in argv if arg != "--sweep"])
    args = _parser().parse_args(argv)
    policies = parse_names(args.policies, POLICIES, "policy")
    workload_names = parse_names(args.workloads, WORKLOADS, "workload")
    duration_s = 8.0 if args.quick else args.duration

    shape = EngineShape(workers=args.workers, block_size=16, max_num_batched_tokens=512, max_model_len=2048,
                        profile=load_profile(args.sim_profile), sim_speedup=args.sim_speedup,
                        mix=parse_shapes(args.shapes))
    tenants = TenantsWorkload(tenants=args.tenants or 2 * args.workers, prefix_tokens=args.prefix_tokens,
                              query_tokens=args.query_tokens, max_tokens=args.max_tokens, kv_fill=args.kv_fill,
                              **({"load": args.load} if args.load is not None else {}))
    conversations = ConversationsWorkload(turns=args.turns, kv_fill=args.kv_fill,
                                          **({"load": args.load} if args.load is not None else {}))
    conversations.check(shape.max_model_len)
    workloads = {"tenants": tenants, "multi-turn": conversations}

    from shared.tiny_model import model_dir_or_tiny

    state_dir = Path(args.state_dir)
    worker_settings: Settings = {"block_size": shape.block_size, "max_num_batched_tokens": shape.max_num_batched_tokens,
                                 "max_model_len": shape.max_model_len, "max_num_seqs": args.max_num_seqs,
                                 **({"sim_profile": args.sim_profile} if args.sim_profile else {}),
                                 **({"kv_transfer": False} if args.no_kv_transfer else {})}
    setup = Setup(shape=shape, model_dir=model_dir_or_tiny(args.model_dir, state_dir), log_root=state_dir / "logs",
                  worker_settings=worker_settings, seed=args.seed, duration_s=duration_s, drain_s=args.drain)
    plans = {policy: router_plan(policy) for policy in policies}

    rows = [run_one(setup, name, workloads[name], policy, plans[policy])
            for name in workload_names for policy in policies]
    document = {
        "bench": "routing",
        "config": {"workers": shape.workers, "duration_s": duration_s, "sim_speedup": shape.sim_speedup,
                   "profile": shape.profile.name, "kv_fill": args.kv_fill, "kv_transfer": not args.no_kv_transfer,
                   "shapes": [mixed.name for mixed in shape.mix],
                   "tenants": dataclasses.asdict(tenants), "multi_turn": dataclasses.asdict(conversations),
                   "seed": args.seed},
        "policies": {policy: plan.impl for policy, plan in plans.items()},
        "results": rows,
        "p90_ratio_vs_kv_aware": p90_ratios(rows),
    }
    json.dump(document, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
