"""What a router's CPU per request does as its own request rate falls: Tandem's router (one
process) and Dynamo's frontend in the same run, each offered the same open-loop rates.

N routers behind one address at the same total load each serve 1/N of the requests, so
"2 routers' summed CPU per request against one router's" holds, besides what a router pays
for its peers' requests, how one router's CPU per request changes from rate R to R/2. This
measures that change alone, for both systems: one router each, no peers.

    python -m bench.router.rate_cost [--rates 50,100,200] [--rounds 3] [--seconds 12]
        [--systems tandem,dynamo] [--dynamo-venv DIR] [--out FILE]

Each round offers every rate to every system (streaming completions of 8 tokens, at most 64
in flight, `--seconds` worth of requests), the order of rates and of systems alternating from
round to round. First, per system, its router's CPU a second with no requests (after a
warm-up). Then per system and rate: router CPU-µs per request (from `/proc`, all threads,
over the requests sent), per round and as median and spread; and per round the ratio of each
rate's figure to the highest rate's, with its median and spread. Prints one JSON document on
stdout, progress on stderr. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path

from bench.options import add_model_dir
from bench.router.load import Phase, process_cpu_s, run_phase
from bench.router.main import system_names
from bench.router.report import phase_figures, spread
from bench.router.systems import EngineSetup, RouterSystem, dynamo_system, tandem_system
from bench.routing.dynamo import VENV_ENV

MAX_TOKENS = 8
IN_FLIGHT = 64
WARMUP_REQUESTS = 200


def _progress(message: str) -> None:
    print(f"rate_cost: {message}", file=sys.stderr, flush=True)


def _positive_numbers(value: str) -> list[float]:
    try:
        numbers = [float(part) for part in value.split(",") if part.strip()]
    except ValueError:
        numbers = []
    if not numbers or any(number <= 0 for number in numbers):
        raise argparse.ArgumentTypeError(f"--rates takes positive requests-per-second figures such as 50,100,200, "
                                         f"not {value!r}")
    return sorted(set(numbers))


def rate_ratios(runs: Sequence[Mapping]) -> dict:
    """Per system and rate, from runs of `{round, system, rate_rps, router_cpu_us_per_request}`:
    the CPU per request's spread over rounds, and its ratio to the same round's figure at the
    highest rate, per round and as a spread."""
    result: dict = {}
    for system in sorted({run["system"] for run in runs}):
        own = [run for run in runs if run["system"] == system]
        top = max(run["rate_rps"] for run in own)
        at_top = {run["round"]: run["router_cpu_us_per_request"] for run in own if run["rate_rps"] == top}
        result[system] = {}
        for rate in sorted({run["rate_rps"] for run in own}):
            at_rate = sorted((run for run in own if run["rate_rps"] == rate), key=lambda run: run["round"])
            per_round = [round(run["router_cpu_us_per_request"] / at_top[run["round"]], 3)
                         for run in at_rate if at_top.get(run["round"])]
            result[system][f"{rate:g}"] = {
                "router_cpu_us_per_request": spread([run["router_cpu_us_per_request"] for run in at_rate]),
                f"ratio_to_{top:g}_per_s": {**spread(per_round), "per_round": per_round},
            }
    return result


def _measure(system: RouterSystem, rate: float, seconds: float, round_index: int) -> dict:
    count = max(1, int(rate * seconds))
    run = asyncio.run(run_phase(system, Phase("concurrent", count, IN_FLIGHT, MAX_TOKENS, rate_rps=rate),
                                offset=(round_index + 1) * 1_000_000 + int(rate) * 1000))
    figures = {"round": round_index, "system": system.name, "rate_rps": rate, **phase_figures(run)}
    _progress(f"round {round_index + 1} {system.name} at {rate:g}/s: {figures['router_cpu_us_per_request']} "
              f"CPU-us per request, {figures['errors']} errors")
    return figures


def idle_cpu_ms_per_s(system: RouterSystem, seconds: float) -> float:
    """The router processes' CPU milliseconds a second while nobody sends requests."""
    before = sum(process_cpu_s(pid) for pid in system.router_pids)
    started = time.monotonic()
    time.sleep(seconds)
    spent = sum(process_cpu_s(pid) for pid in system.router_pids) - before
    return round(spent * 1000 / (time.monotonic() - started), 2)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.router.rate_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=_positive_numbers, default=[50.0, 100.0, 200.0],
                        help="open-loop rates, requests a second, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=12.0, help="how long each rate is offered, per round")
    parser.add_argument("--idle-seconds", type=float, default=10.0,
                        help="how long each system's router CPU is read with no requests, after the warm-up")
    parser.add_argument("--systems", default="", help="tandem and/or dynamo (default: both when a Dynamo venv is set)")
    parser.add_argument("--dynamo-venv", default="", help=f"Dynamo's venv (default: ${VENV_ENV})")
    add_model_dir(parser)
    parser.add_argument("--state-dir", default=".tandem/bench-router", help="logs and the generated model")
    parser.add_argument("--out", default="", help="also write the JSON document to this file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.seconds <= 0 or args.idle_seconds <= 0:
        parser.error("--rounds, --seconds and --idle-seconds must be positive")
    names = system_names(args, parser)
    from shared.tiny_model import model_dir_or_tiny

    state_dir = Path(args.state_dir)
    model_dir = model_dir_or_tiny(args.model_dir, state_dir)
    engines = EngineSetup()
    load_at_start = os.getloadavg()[0]
    runs: list[dict] = []
    idle: dict[str, float] = {}
    with ExitStack() as running:
        systems: list[RouterSystem] = []
        if "tandem" in names:
            _progress(f"starting Tandem: 1 router, {engines.workers} sim workers at {engines.speedup:g}x")
            systems.append(running.enter_context(tandem_system(1, model_dir, state_dir / "logs-rate-tandem", engines)))
        if "dynamo" in names:
            _progress(f"starting Dynamo: frontend (kv router), {engines.workers} mocker workers")
            systems.append(running.enter_context(dynamo_system(model_dir, state_dir / "logs-rate-dynamo", engines,
                                                               venv=args.dynamo_venv or None)))
        for system in systems:
            asyncio.run(run_phase(system, Phase("warmup", WARMUP_REQUESTS, 32, MAX_TOKENS)))
        for system in systems:
            idle[system.name] = idle_cpu_ms_per_s(system, args.idle_seconds)
            _progress(f"{system.name} idle: {idle[system.name]} CPU-ms a second")
        for round_index in range(args.rounds):
            rates = args.rates if round_index % 2 == 0 else args.rates[::-1]
            for rate_index, rate in enumerate(rates):
                order = systems if (round_index + rate_index) % 2 == 0 else systems[::-1]
                runs.extend(_measure(system, rate, args.seconds, round_index) for system in order)
    document = {
        "config": {"rates_rps": args.rates, "rounds": args.rounds, "seconds": args.seconds,
                   "idle_seconds": args.idle_seconds, "systems": names,
                   "max_tokens": MAX_TOKENS, "in_flight_at_most": IN_FLIGHT, "workers": engines.workers,
                   "speedup": engines.speedup, "client": "bench.serve.client, a fresh connection per request"},
        "host": {"cpus": os.cpu_count(), "load_average_1m_start": round(load_at_start, 2),
                 "load_average_1m_end": round(os.getloadavg()[0], 2)},
        "idle_cpu_ms_per_s": idle,
        "systems": rate_ratios(runs),
        "runs": runs,
    }
    text = json.dumps(document, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 1 if any(run["errors"] for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
