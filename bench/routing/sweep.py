"""`tandem bench routing --sweep`: routing quality over a workload family, against an oracle.

Every point of the family (`bench.routing.family`: `DEFAULT_SWEEP`, or `QUICK_SWEEP` with
`--quick`) runs through every arm (`bench.routing.arms`: kv-aware, round-robin without and
with prefix pull, the oracle), each on a freshly started system (`bench.routing.systems`),
with the same seeded requests; the arm order rotates from run to run. With `--repeats N`
each point runs N times through every arm (alternated: one run of each arm, then the next
repeat), and its verdict judges the median of each check's per-run ratio, with the spread
(the machine may be shared and noisy; one short run's P90 rests on a dozen requests). Per row: TTFT
percentiles, errors, throughput, cached share split into local hits and pulled tokens, pulled,
recomputed and computed prompt tokens, evictions, load imbalance. Per point a verdict
(`bench.routing.report`).

    tandem bench routing --sweep [--quick] [--points few-large,bursts] [--arms kv-aware,oracle] [--repeats 3]

Workers are sim engines by default; `--engine vllm` (from the vLLM venv, with `--block-size
128` on CPU, `--sim-speedup 1` and a `--sim-profile` of the model for sizing the offered
rate) runs real engines of the model, their KV caches sized as the sim's would be.

prints one JSON document (`{"config", "points", "arms", "results", "verdicts", "gains",
"summary", "pass"}`) on stdout, progress on stderr. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.options import add_model_dir
from bench.routing.arms import DEFAULT_ARMS, Arm, NoPinning, Pinning, RequestRouting, arms, rotated
from bench.routing.client import progress
from bench.routing.family import (
    DEFAULT_DURATION_S,
    DEFAULT_SWEEP,
    QUICK_DURATION_S,
    QUICK_SWEEP,
    TIER_SWEEP,
    PointSizing,
    SweepPoint,
    at_load,
    points_named,
    size_point,
)
from bench.routing.fleet_shapes import parse_shapes
from bench.routing.main import parse_names
from bench.routing.oracle import GroupSpec, Oracle
from bench.routing.report import gains, median_gains, over_repeats, summary, table, verdict
from bench.routing.sweep_drive import PointRun, drive_point
from bench.routing.systems import LAUNCHERS, Launcher, LaunchError, LaunchSpec, System, cpu_seconds
from bench.routing.workloads import EngineShape
from launch.definition import Settings

ORACLE_CACHE_ROOM = 0.9  # of a worker's KV: the rest holds running requests' own blocks


@dataclass(frozen=True)
class SweepSetup:
    shape: EngineShape
    model_dir: str
    vocab_size: int
    log_root: Path
    worker_settings: Settings
    seed: int
    duration_s: float
    drain_s: float
    kv_overrides: Mapping[str, object] = dataclasses.field(default_factory=dict)
    repeats: int = 1  # runs of each point through every arm
    engine: str = "sim"  # the workers'


def oracle_for(point: SweepPoint, shape: EngineShape, sizing: PointSizing, worker_ids: Sequence[str],
               learn_per_group: int = 0) -> Oracle:
    """The oracle of one point on workers `worker_ids`: tenants placed up front (or, with
    `learn_per_group`, by the shares counted over that many requests per tenant),
    conversations on first sight. A request that misses its prefix weighs what prefilling it
    costs over prefilling only its own part."""
    cached_s = shape.uncached_request_s(point.query_tokens)
    tenant_miss = shape.uncached_request_s(point.prefix_tokens + point.query_tokens) / cached_s
    groups = {name: GroupSpec(point.prefix_tokens, share, tenant_miss) for name, share in point.group_shares().items()}
    dynamic = (GroupSpec(sizing.conversation_tokens, (1 - point.unique_share) / sizing.live_conversations,
                         shape.uncached_request_s(sizing.conversation_tokens) / cached_s)
               if point.turns > 1 else None)
    return Oracle(worker_ids, int(sizing.kv_tokens_per_worker * ORACLE_CACHE_ROOM), groups, dynamic_spec=dynamic,
                  learn_requests=learn_per_group * len(groups))


def routing_for(arm: Arm, point: SweepPoint, shape: EngineShape, sizing: PointSizing,
                system: System) -> RequestRouting:
    if not arm.oracle:
        return NoPinning()
    if not system.worker_ids:
        raise LaunchError(f"arm {arm.name}: the system lists no worker ids to pin to")
    return Pinning(oracle_for(point, shape, sizing, system.worker_ids, arm.learn_per_group))


def run_arm(setup: SweepSetup, point: SweepPoint, sizing: PointSizing, arm: Arm, launcher: Launcher | None,
            repeat: int = 0) -> dict:
    row = {"point": point.name, "arm": arm.name, "system": arm.system, "settings": arm.settings}
    label = f"{point.name}-{arm.name}"
    if setup.repeats > 1:
        row["repeat"] = repeat
        label += f"-{repeat}"
    if launcher is None:
        return {**row, "error": f"no launcher for system {arm.system!r}"}
    shape = setup.shape
    offered = (f"{sizing.users} users" if point.closed_loop else f"{sizing.rate_rps:.1f} req/s")
    host = f" (+{sizing.kv_host_blocks} in host memory)" if sizing.kv_host_blocks else ""
    progress(f"{point.name} / {arm.name}{f' / repeat {repeat}' if setup.repeats > 1 else ''}: {shape.workers} workers x {sizing.kv_blocks} KV blocks{host}, {offered} "
             f"for {setup.duration_s:g}s ({json.dumps(arm.settings)})")
    spec = LaunchSpec(label=label, arm=arm, shape=shape, kv_blocks=sizing.kv_blocks, kv_host_blocks=sizing.kv_host_blocks,
                      model_dir=setup.model_dir, worker_settings=setup.worker_settings,
                      log_dir=setup.log_root / label, engine=setup.engine)
    run = PointRun(point=point, shape=shape, sizing=sizing, vocab_size=setup.vocab_size, seed=setup.seed,
                   duration_s=setup.duration_s, drain_s=setup.drain_s)
    try:
        with launcher(spec) as system:
            routing = routing_for(arm, point, shape, sizing, system)
            cpu_before, wall_before = cpu_seconds(system.pids), time.monotonic()
            figures = asyncio.run(drive_point(system, run, routing))
            # a machine short of CPU inflates every arm's TTFT: the row shows how busy it was
            figures["cpu_busy"] = round((cpu_seconds(system.pids) - cpu_before)
                                        / ((time.monotonic() - wall_before) * (os.cpu_count() or 1)), 2)
            # and other programs on the machine do too: its 1-minute load average, over its CPUs
            figures["machine_load"] = round(os.getloadavg()[0] / (os.cpu_count() or 1), 2)
    except LaunchError as error:  # the row says so; the other rows still run
        progress(f"  {error}")
        return {**row, "error": str(error)[:500]}
    progress(f"  -> p50/p90/p99 {figures['ttft_p50_ms']}/{figures['ttft_p90_ms']}/{figures['ttft_p99_ms']} ms, "
             f"cached {figures.get('cached_share')} (pulled {figures.get('pulled_share')}), "
             f"evicted {figures.get('evicted_blocks')}, errors {figures['errors']}")
    return {**row, **figures, "offered_rps": round(sizing.rate_rps, 2), "users": sizing.users,
            "kv_blocks_per_worker": sizing.kv_blocks,
            **({"kv_host_blocks_per_worker": sizing.kv_host_blocks} if sizing.kv_host_blocks else {})}


def run_sweep(setup: SweepSetup, points: Sequence[SweepPoint], arm_names: Sequence[str],
              launchers: Mapping[str, Launcher] = LAUNCHERS) -> dict:
    """Every point through every arm; the JSON document."""
    by_name = arms(setup.shape, setup.kv_overrides)
    rows: list[dict] = []
    verdicts: dict[str, dict] = {}
    point_gains: dict[str, dict] = {}
    runs = 0
    for point in points:
        point.check(setup.shape.max_model_len)
        sizing = size_point(point, setup.shape)
        repeat_verdicts: list[dict] = []
        repeat_gains: list[dict] = []
        for repeat in range(setup.repeats):
            point_rows = {name: run_arm(setup, point, sizing, by_name[name], launchers.get(by_name[name].system),
                                        repeat)
                          for name in rotated(list(arm_names), runs)}
            runs += 1
            rows.extend(point_rows[name] for name in arm_names)
            repeat_verdicts.append(verdict(point, point_rows))
            repeat_gains.append(gains(point_rows, {name: by_name[name].baseline for name in arm_names}))
        if setup.repeats > 1:
            verdicts[point.name] = over_repeats(repeat_verdicts)
            point_gains[point.name] = median_gains(repeat_gains)
        else:
            verdicts[point.name], point_gains[point.name] = repeat_verdicts[0], repeat_gains[0]
    outcomes = [check["pass"] for check in verdicts.values()]
    return {
        "bench": "routing-sweep",
        "config": {"engine": setup.engine, "workers": setup.shape.workers, "duration_s": setup.duration_s,
                   "drain_s": setup.drain_s,
                   "sim_speedup": setup.shape.sim_speedup, "profile": setup.shape.profile.name, "seed": setup.seed,
                   "block_size": setup.shape.block_size, "max_model_len": setup.shape.max_model_len,
                   "shapes": [shape.name for shape in setup.shape.mix],
                   "repeats": setup.repeats},
        "points": {point.name: {**dataclasses.asdict(point), "sizing": dataclasses.asdict(size_point(point, setup.shape))}
                   for point in points},
        "arms": {name: {"system": by_name[name].system, "settings": by_name[name].settings,
                        "oracle": by_name[name].oracle} for name in arm_names},
        "results": rows,
        "verdicts": verdicts,
        "gains": point_gains,
        "summary": summary(rows),
        "pass": None if None in outcomes else all(outcomes),
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem bench routing --sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{len(QUICK_SWEEP)} points, {QUICK_DURATION_S:g} s each")
    parser.add_argument("--points", default="", help="comma-separated point names (default: the whole sweep)")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS))
    parser.add_argument("--workers", type=int, default=4, help="workers of role both")
    parser.add_argument("--engine", default="sim", help="the workers' engine (`tandem engines`)")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (vLLM on CPU: 128)")
    parser.add_argument("--duration", type=float, default=0.0, help="seconds of arrivals per run")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each point through every arm; verdicts judge the median per-run ratios")
    parser.add_argument("--drain", type=float, default=20.0,
                        help="seconds to wait for answers after the last arrival; later ones are errors")
    parser.add_argument("--sim-speedup", type=float, default=0.25)
    parser.add_argument("--sim-profile", default="", help="timing profile JSON (default: the packaged one)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    add_model_dir(parser)
    parser.add_argument("--state-dir", default=".tandem/bench-routing", help="logs and the generated model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shapes", default="", help="the workers' shapes in turn (the sim), e.g. tp1,tp2-bs32,pp2 "
                                                      "(default: all alike)")
    parser.add_argument("--load", type=float, default=0.0,
                        help="offered rate / the cluster's cache-blind capacity, for every point (default: each point's own)")
    parser.add_argument("--kv-settings", default="{}",
                        help='router settings for the kv-aware arm, as JSON (e.g. \'{"queue_weight": 1.0}\')')
    parser.add_argument("--json", action="store_true", help="accepted; stdout is always one JSON document")
    return parser


def _kv_overrides(kv_settings: str) -> dict:
    """`--kv-settings`: the kv-aware arm's router settings, a JSON object."""
    try:
        kv_overrides = json.loads(kv_settings)
    except ValueError as error:
        raise SystemExit(f"bench_routing: --kv-settings is not JSON: {error}") from error
    if not isinstance(kv_overrides, dict):
        raise SystemExit("bench_routing: --kv-settings must be a JSON object")
    return kv_overrides


def _chosen_points(args: argparse.Namespace) -> Sequence[SweepPoint]:
    """The points of `--points` (default: the quick or the default sweep), at `--load` if given."""
    family = QUICK_SWEEP if args.quick else DEFAULT_SWEEP
    try:
        names = [point.name for point in DEFAULT_SWEEP + TIER_SWEEP]
        points = points_named(parse_names(args.points, names, "point")) if args.points else family
        return at_load(points, args.load) if args.load else points
    except ValueError as error:
        raise SystemExit(f"bench_routing: {error}") from error


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    kv_overrides = _kv_overrides(args.kv_settings)
    if args.repeats < 1:
        raise SystemExit(f"bench_routing: --repeats must be at least 1, got {args.repeats}")
    if args.load < 0:
        raise SystemExit(f"bench_routing: --load must be positive, got {args.load}")
    from services.worker.sim.profile import load_profile
    from shared.tokenizer import Tokenizer

    points = _chosen_points(args)
    from services.worker.engines import engine_names

    if args.engine not in engine_names():
        raise SystemExit(f"bench_routing: no engine {args.engine!r}; one of {', '.join(engine_names())}")
    try:
        mix = parse_shapes(args.shapes)
    except ValueError as error:
        raise SystemExit(f"bench_routing: {error}") from error
    shape = EngineShape(workers=args.workers, block_size=args.block_size, max_num_batched_tokens=512,
                        max_model_len=2048,
                        profile=load_profile(args.sim_profile), sim_speedup=args.sim_speedup, mix=mix)
    arm_names = parse_names(args.arms, list(arms(shape)), "arm")
    from shared.tiny_model import model_dir_or_tiny

    state_dir = Path(args.state_dir)
    model_dir = model_dir_or_tiny(args.model_dir, state_dir)
    worker_settings: Settings = {"block_size": shape.block_size, "max_num_batched_tokens": shape.max_num_batched_tokens,
                                 "max_model_len": shape.max_model_len, "max_num_seqs": args.max_num_seqs,
                                 **({"sim_profile": args.sim_profile} if args.sim_profile else {})}
    setup = SweepSetup(shape=shape, model_dir=model_dir, vocab_size=Tokenizer.from_model_dir(model_dir).vocab_size,
                       log_root=state_dir / "logs" / "sweep", worker_settings=worker_settings, seed=args.seed,
                       duration_s=args.duration or (QUICK_DURATION_S if args.quick else DEFAULT_DURATION_S),
                       drain_s=args.drain, kv_overrides=kv_overrides, repeats=args.repeats, engine=args.engine)
    started = time.monotonic()
    document = run_sweep(setup, points, arm_names)
    document["config"]["wall_s"] = round(time.monotonic() - started, 1)
    progress("summary:\n" + table(document["results"]))
    progress(f"verdicts: {json.dumps({name: check['pass'] for name, check in document['verdicts'].items()})}")
    json.dump(document, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0
