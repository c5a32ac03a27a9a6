"""`tandem bench router`: Tandem's router beside Dynamo's frontend, engines at near-zero cost.

    tandem bench router [--rounds 5] [--concurrency 32] [--requests 400] [--sequential 100]
                        [--max-tokens 8] [--routers 1] [--systems tandem,dynamo] [--out FILE]

Starts each system once (Tandem: a local stack of 2 sim workers at `--speedup`, 1 router
process; Dynamo, when its venv is set (`$TANDEM_DYNAMO_VENV` or `--dynamo-venv`): its
frontend and KV router before 2 mocker engines at the same speed-up), warms each up, then
runs `--rounds` rounds; each round runs every system in turn (the order alternates from
round to round) through two phases with the same client and prompts:

- concurrent: `--requests` streaming completions of `--max-tokens` tokens, `--concurrency`
  in flight (closed loop), or with `--rate R` sent R a second (open loop, at most
  `--concurrency` in flight: each system offered the same load): requests/s, end-to-end
  p50/p99, router CPU-µs per request;
- sequential: `--sequential` single-token streaming completions one after another: the
  per-request latency floor (p50/p99) and CPU.

Prints one JSON document on stdout (`bench.router.report`: per round, per system median and
spread, the ratio Tandem/Dynamo's median and spread, the goals); progress goes to stderr.
`--routers 1,2,4` runs a Tandem stack with that many router processes on one port for each
count, each its own system (CPU per request summed over its routers), and the ratio of each
to the one-router stack.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

from bench.options import add_model_dir
from bench.router.load import Phase, run_phase
from bench.router.report import goals, phase_figures, ratios, system_summary
from bench.router.systems import (
    EngineSetup,
    RouterSystem,
    UnsupportedRouters,
    check_router_count,
    dynamo_system,
    tandem_system,
)
from bench.routing.dynamo import VENV_ENV, DynamoUnavailable, dynamo_python


def _progress(message: str) -> None:
    print(f"bench_router: {message}", file=sys.stderr, flush=True)


def tandem_label(routers: int) -> str:
    return "tandem" if routers == 1 else f"tandem-{routers}-routers"


def run_round(systems: Sequence[RouterSystem], phases: Sequence[Phase], round_index: int) -> dict:
    """Each system through every phase, in an order that alternates with the round."""
    order = list(systems) if round_index % 2 == 0 else list(reversed(systems))
    result: dict = {}
    for system in order:
        figures = {}
        for phase in phases:
            run = asyncio.run(run_phase(system, phase, offset=round_index * 100_000))
            figures[phase.name] = phase_figures(run)
        result[system.name] = figures
        concurrent, sequential = figures.get("concurrent", {}), figures.get("sequential", {})
        _progress(f"round {round_index + 1} {system.name}: {concurrent.get('requests_per_s')} req/s "
                  f"(p50 {concurrent.get('p50_ms')} ms, {concurrent.get('router_cpu_us_per_request')} CPU-us/req, "
                  f"{concurrent.get('errors')} errors); sequential p50 {sequential.get('p50_ms')} ms")
    return result


def _parse_routers(value: str) -> list[int]:
    try:
        counts = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--routers takes router counts such as 1,2,4, not {value!r}") from None
    if not counts or any(count < 1 for count in counts):
        raise argparse.ArgumentTypeError(f"--routers takes positive counts, not {value!r}")
    return counts


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem bench router", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds; each runs every system once")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight in the concurrent phase")
    parser.add_argument("--rate", type=float, default=0.0,
                        help="open loop: the concurrent phase sends this many requests a second, at most "
                             "--concurrency in flight (0: closed loop); every system is offered the same load")
    parser.add_argument("--requests", type=int, default=400, help="requests of the concurrent phase, per round")
    parser.add_argument("--sequential", type=int, default=100,
                        help="single-token requests of the sequential phase, per round (0: no such phase)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per request of the concurrent phase")
    parser.add_argument("--warmup", type=int, default=64, help="requests each system serves before round 1")
    parser.add_argument("--routers", type=_parse_routers, default=[1],
                        help="Tandem router processes, comma-separated (one Tandem system per count)")
    parser.add_argument("--systems", default="",
                        help="tandem, dynamo or both, comma-separated (default: both when a Dynamo venv is set)")
    parser.add_argument("--dynamo-venv", default="", help=f"Dynamo's venv (default: ${VENV_ENV})")
    parser.add_argument("--workers", type=int, default=2, help="engines per system")
    parser.add_argument("--speedup", type=float, default=1000.0, help="engine speed-up (sim and mocker)")
    parser.add_argument("--kv-event-interval", type=float, default=0.0,
                        help="seconds between a Tandem worker's KV event flushes (default: the worker's own)")
    add_model_dir(parser)
    parser.add_argument("--state-dir", default=".tandem/bench-router", help="logs and the generated model")
    parser.add_argument("--out", default="", help="also write the JSON document to this file")
    return parser


def system_names(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """The systems `args.systems` names (default: both when a Dynamo venv is set), a Dynamo
    venv checked when Dynamo is one; a bad value is the parser's error."""
    venv = args.dynamo_venv or os.environ.get(VENV_ENV, "")
    names = [name.strip() for name in args.systems.split(",") if name.strip()] or (
        ["tandem", "dynamo"] if venv else ["tandem"])
    unknown = set(names) - {"tandem", "dynamo"}
    if unknown or not names:
        parser.error(f"--systems takes tandem and/or dynamo, not {args.systems!r}")
    if "dynamo" in names:
        try:
            dynamo_python(venv or None)
        except DynamoUnavailable as error:
            parser.error(str(error))
    return names


def _start_systems(running: ExitStack, args: argparse.Namespace, names: Sequence[str], model_dir: str,
                   state_dir: Path, engines: EngineSetup) -> list[RouterSystem]:
    """The systems `names` asks for, started in `running` (which stops them): one Tandem system
    per router count, then Dynamo."""
    systems: list[RouterSystem] = []
    if "tandem" in names:
        for routers in args.routers:
            _progress(f"starting Tandem: {routers} router(s), {args.workers} sim workers at {args.speedup:g}x")
            system = running.enter_context(tandem_system(routers, model_dir, state_dir / f"logs-tandem-{routers}",
                                                         engines))
            systems.append(RouterSystem(name=tandem_label(routers), base_urls=system.base_urls,
                                        model=system.model, router_pids=system.router_pids))
    if "dynamo" in names:
        _progress(f"starting Dynamo: frontend (kv router), {args.workers} mocker workers at {args.speedup:g}x")
        systems.append(running.enter_context(dynamo_system(model_dir, state_dir / "logs-dynamo", engines,
                                                           venv=args.dynamo_venv or None)))
    return systems


def _document(config: dict, duration_s: float, load_at_start: float, rounds: list[dict], labels: list[str]) -> dict:
    """The JSON document: the config, the host's load, per system its summary over the rounds,
    the ratios between systems, and every round's figures."""
    return {
        "config": config,
        "duration_s": round(duration_s, 1),
        # the box's own load says how much the figures can be trusted (other work shares its cores)
        "host": {"cpus": os.cpu_count(), "load_average_1m_start": round(load_at_start, 2),
                 "load_average_1m_end": round(os.getloadavg()[0], 2)},
        "systems": {label: system_summary(rounds, label) for label in labels},
        "ratios": {**{f"{label}/dynamo": ratios(rounds, label, "dynamo")
                      for label in labels if label != "dynamo" and "dynamo" in labels},
                   # several routers against one (requests/s: the scaling; p50: what it costs)
                   **{f"{label}/tandem": ratios(rounds, label, "tandem")
                      for label in labels if label.startswith("tandem-") and "tandem" in labels}},
        "rounds": rounds,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.concurrency < 1 or args.requests < 1 or args.sequential < 0 or args.max_tokens < 1:
        parser.error("--rounds, --concurrency, --requests and --max-tokens must be positive, --sequential not negative")
    if args.rate < 0:
        parser.error(f"--rate must not be negative, got {args.rate}")
    if args.kv_event_interval < 0:
        parser.error(f"--kv-event-interval must not be negative, got {args.kv_event_interval}")
    names = system_names(args, parser)
    try:
        for routers in args.routers:
            check_router_count(routers)
    except UnsupportedRouters as error:
        parser.error(str(error))
    state_dir = Path(args.state_dir)
    from shared.tiny_model import model_dir_or_tiny

    model_dir = model_dir_or_tiny(args.model_dir, state_dir)
    engines = EngineSetup(workers=args.workers, speedup=args.speedup, kv_event_interval_s=args.kv_event_interval)
    phases = [Phase("concurrent", args.requests, args.concurrency, args.max_tokens, rate_rps=args.rate)]
    if args.sequential:
        phases.append(Phase("sequential", args.sequential, 1, 1))
    config = {key: value for key, value in vars(args).items() if key not in ("out", "state_dir", "dynamo_venv")}
    config.update(systems=names, model_dir=model_dir, client="bench.serve.client, a fresh connection per request",
                  prompt="text, some ten tokens", ignore_eos=True)

    started = time.monotonic()
    load_at_start = os.getloadavg()
    rounds: list[dict] = []
    with ExitStack() as running:
        systems = _start_systems(running, args, names, model_dir, state_dir, engines)
        if args.warmup:
            for system in systems:
                _progress(f"warming up {system.name} ({args.warmup} requests)")
                asyncio.run(run_phase(system, Phase("warmup", args.warmup, args.concurrency, args.max_tokens),
                                      offset=10**9))
        for round_index in range(args.rounds):
            rounds.append(run_round(systems, phases, round_index))
        labels = [system.name for system in systems]

    document = _document(config, time.monotonic() - started, load_at_start[0], rounds, labels)
    if "tandem/dynamo" in document["ratios"]:
        document["goals"] = goals(document["ratios"]["tandem/dynamo"])
    text = json.dumps(document, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
