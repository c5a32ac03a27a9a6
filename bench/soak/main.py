"""Soak benchmark: a local stack under a mixed workload for minutes.

    tandem bench soak [--minutes 10] [--concurrency 16] [--seed 0] [--json] [--out FILE]
                      [--prefill 1] [--decode 2] [--engine sim] [--sim-speedup 1]

Starts a local stack (the one `tandem up` runs: nats-server, orchestrator, metrics
collector, router, `--prefill` prefill and `--decode` decode workers; the router decides
per request whether to disaggregate), then keeps `--concurrency` clients busy with a mixed
workload (`bench.soak.workload`: streaming and whole answers, completions and chat, shared
prefixes, varied lengths, some clients giving up early) until the time is up. Every
`--sample-interval` seconds it reads the RSS of every stack process and prints a progress
line on stderr. When the load stops, it gives the stack `--settle` seconds to become idle
and reads what is left (leases, used KV blocks, requests), then stops the stack.

Prints the result (`bench.soak.report`) on stdout: one JSON document with `--json` (and to
`--out`), else a short summary. Exits 1 when the verdict fails. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.options import add_model_dir
from bench.serve.client import make_client, served_model
from bench.soak.client import RequestResult, send
from bench.soak.leftovers import LoadReports
from bench.soak.report import MAX_RSS_SLOPE_MB_MIN, Bounds, request_figures, rss_figures, verdict
from bench.soak.rss import RssSampler
from bench.soak.workload import RequestMaker, WorkloadMix
from launch.plan import StackConfig, WorkerSpec
from launch.stack import LocalStack
from shared.bus import connect
from shared.schemas import WorkerRole
from shared.subjects import Subjects

PROGRESS_EVERY_S = 10.0


def _progress(message: str) -> None:
    print(f"bench_soak: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class SoakConfig:
    minutes: float = 10.0
    concurrency: int = 16
    seed: int = 0
    prefill: int = 1
    decode: int = 2
    engine: str = "sim"
    sim_speedup: float = 1.0
    sample_interval_s: float = 0.0  # 0: from the duration (5 s for runs of 200 s and more)
    request_timeout_s: float = 60.0  # a request still open this long is a hang (an error)
    settle_s: float = 20.0
    mix: WorkloadMix = WorkloadMix()

    @property
    def duration_s(self) -> float:
        return self.minutes * 60.0

    def resolved_sample_interval_s(self) -> float:
        return self.sample_interval_s or min(5.0, max(0.5, self.duration_s / 40))


def stack_config(config: SoakConfig, model_dir: str, log_dir: Path) -> StackConfig:
    settings = {"sim_speedup": config.sim_speedup}  # a worker's flag that engines other than the sim ignore
    workers = (*(WorkerSpec(worker_id=f"p{i + 1}", role=WorkerRole.PREFILL, settings=settings)
                 for i in range(config.prefill)),
               *(WorkerSpec(worker_id=f"d{i + 1}", role=WorkerRole.DECODE if config.prefill else WorkerRole.BOTH,
                            settings=settings) for i in range(config.decode)))
    return StackConfig(model_dir=model_dir, engine=config.engine, workers=workers, router_port=0, metrics_port=0,
                       namespace="soak" + uuid.uuid4().hex[:8], log_dir=str(log_dir))


def stack_pids(stack: LocalStack) -> dict[str, int]:
    pids = {name: process.pid for name, process in stack.processes.items()}
    if stack.nats is not None and stack.nats.process is not None:
        pids["nats"] = stack.nats.process.pid
    return pids


async def drive(stack: LocalStack, config: SoakConfig, bounds: Bounds) -> dict:
    """Run the workload against the started stack; the result document (no config)."""
    workers = [spec.worker_id for spec in stack.config.workers]
    bus = await connect(stack.nats_url, "bench-soak")
    try:
        reports = LoadReports()
        await reports.start(bus, Subjects(stack.config.namespace).load_all)
        async with make_client(stack.router_url, config.request_timeout_s) as http:
            model = await served_model(http)
            maker = RequestMaker(config.seed, config.mix)
            sampler = RssSampler(stack_pids(stack))
            sampler.sample()
            results: list[RequestResult] = []
            started = time.monotonic()
            deadline = started + config.duration_s

            async def lane() -> None:
                while time.monotonic() < deadline:
                    results.append(await send(http, model, maker.next(), config.request_timeout_s))

            async def sample() -> None:
                interval = config.resolved_sample_interval_s()
                reported = started
                while time.monotonic() < deadline:
                    await asyncio.sleep(min(interval, max(0.0, deadline - time.monotonic())))  # the sampling period
                    reading = sampler.sample()
                    if time.monotonic() - reported >= PROGRESS_EVERY_S or time.monotonic() >= deadline:
                        reported = time.monotonic()
                        _progress(_progress_line(reported - started, config.duration_s, results, reading))

            await asyncio.gather(sample(), *(lane() for _ in range(config.concurrency)))
            duration_s = time.monotonic() - started
            _progress(f"load stopped after {duration_s:.1f}s; waiting up to {config.settle_s}s for the stack to idle")
            leftovers = await reports.settle(http, workers, config.settle_s)
            sampler.sample()
    finally:
        await bus.close()
    memory = {name: rss_figures(samples, duration_s, bounds) for name, samples in sampler.samples.items()}
    requests = request_figures(results, duration_s)
    return {"duration_s": round(duration_s, 1), "model": model, "requests": requests, "memory": memory,
            "leftovers": leftovers.document(), "verdict": verdict(memory, requests, leftovers, bounds)}


def _progress_line(elapsed_s: float, total_s: float, results: list[RequestResult], reading: dict) -> str:
    outcomes = {name: sum(result.outcome == name for result in results) for name in ("ok", "cancelled", "error")}
    rss = " ".join(f"{name} {value / 2**20:.0f}" for name, value in reading.items() if value is not None)
    return (f"{elapsed_s:.0f}/{total_s:.0f}s: {len(results)} requests ({outcomes['ok']} ok, "
            f"{outcomes['cancelled']} cancelled, {outcomes['error']} errors); RSS MB: {rss}")


def run(config: SoakConfig, bounds: Bounds, model_dir: str, state_dir: Path) -> dict:
    stack = LocalStack(stack_config(config, model_dir, state_dir / "logs"))
    _progress(f"starting a stack of {config.prefill} prefill and {config.decode} decode {config.engine} workers")
    stack.start()
    try:
        _progress(f"stack up (router {stack.router_url}); driving {config.concurrency} clients for "
                  f"{config.duration_s:.0f}s")
        result = asyncio.run(drive(stack, config, bounds))
    finally:
        stack.stop()
    return {"config": {**asdict(config), "sample_interval_s": config.resolved_sample_interval_s(),
                       "model_dir": model_dir}, **result}


def summary(document: dict) -> str:
    requests, verdict_ = document["requests"], document["verdict"]
    lines = [f"soak {document['duration_s']}s: {requests['total']} requests {requests['by_outcome']}, "
             f"latency p50 {requests['latency_ms']['p50']} ms p99 {requests['latency_ms']['p99']} ms",
             *(f"  {name}: RSS {m.get('start_mb')} -> {m.get('end_mb')} MB (max {m.get('max_mb')}), "
               f"slope {m.get('slope_mb_per_min_second_half')} MB/min" for name, m in document["memory"].items()),
             f"  leftovers: {document['leftovers']['total']}",
             f"verdict: {'PASS' if verdict_['pass'] else 'FAIL'} {'; '.join(verdict_['reasons'])}".rstrip()]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    from services.worker.engines import engine_names

    parser = argparse.ArgumentParser(prog="tandem bench soak", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the load runs")
    parser.add_argument("--concurrency", type=int, default=16, help="clients sending requests (closed loop)")
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed")
    parser.add_argument("--json", action="store_true", help="print the JSON document (default: a summary)")
    parser.add_argument("--out", default="", help="also write the JSON document to this file")
    parser.add_argument("--cancel-fraction", type=float, default=WorkloadMix().cancel_fraction,
                        help="requests the client gives up on early")
    parser.add_argument("--stream-fraction", type=float, default=WorkloadMix().stream_fraction,
                        help="requests that stream")
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers (0: workers of role both)")
    parser.add_argument("--decode", type=int, default=2, help="decode workers")
    parser.add_argument("--engine", choices=engine_names(), default="sim")
    add_model_dir(parser)
    parser.add_argument("--sim-speedup", type=float, default=1.0, help="sim: run the engine this much faster")
    parser.add_argument("--sample-interval", type=float, default=0.0,
                        help="seconds between RSS samples (default: duration/40, between 0.5 and 5)")
    parser.add_argument("--request-timeout", type=float, default=60.0, help="seconds before a request is a hang")
    parser.add_argument("--settle", type=float, default=20.0, help="seconds the stack has to idle at the end")
    parser.add_argument("--max-rss-slope", type=float, default=MAX_RSS_SLOPE_MB_MIN,
                        help="MB/min a process may grow over the second half")
    parser.add_argument("--state-dir", default=".tandem/bench-soak", help="logs and the generated model")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.concurrency < 1 or args.decode < 1 or args.prefill < 0:
        parser.error("--minutes and --concurrency must be positive, --decode at least 1, --prefill not negative")
    try:
        mix = WorkloadMix(cancel_fraction=args.cancel_fraction, stream_fraction=args.stream_fraction)
    except ValueError as error:
        parser.error(str(error))
    config = SoakConfig(minutes=args.minutes, concurrency=args.concurrency, seed=args.seed, prefill=args.prefill,
                        decode=args.decode, engine=args.engine, sim_speedup=args.sim_speedup,
                        sample_interval_s=args.sample_interval, request_timeout_s=args.request_timeout,
                        settle_s=args.settle, mix=mix)
    state_dir = Path(args.state_dir)
    from shared.tiny_model import model_dir_or_tiny

    model_dir = model_dir_or_tiny(args.model_dir, state_dir)
    document = run(config, Bounds(max_rss_slope_mb_min=args.max_rss_slope), model_dir, state_dir)
    text = json.dumps(document, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text if args.json else summary(document), flush=True)
    return 0 if document["verdict"]["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
