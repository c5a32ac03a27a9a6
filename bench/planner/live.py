"""`tandem bench planner live`: the SLO planner on real engines in real time, against static splits.

    tandem bench planner live --engine vllm MODEL [--workers 3] [--start 1:2]
        [--splits 1:2,2:1] [--phase-s 120] [--ttft-slo-ms 3000] [--itl-slo-ms 150]
        [--decode-phase RATE:PROMPT:OUTPUT] [--prefill-phase RATE:PROMPT:OUTPUT]
        [--sim-profile FILE] [--seed 0] [--out FILE]

(MODEL: the model directory option every bench command declares, `bench.options.add_model_dir`.)

One seeded workload of two phases, decode-heavy then prefill-heavy, drawn as the simulated
bench draws its arrivals (`bench.planner.sim.arrivals`: Poisson, each request's prompt and
output within 25% of its phase's), sent to one fresh local stack per arm (the way `tandem
up` runs one; stopped before the next arm starts, so no cache carries over):

- each static split of the `--workers` budget (`--splits`), the orchestrator's planner off;
- the planner (`tandem orchestrator --planner`, short sustain and cooldown for a run of
  minutes) starting from `--start`: its role switches are real (the worker re-registers
  and the router sends it the other part of each request).

Every arm sees the same requests at the same offsets, streamed with temperature 0 and
`ignore_eos` (each asks its exact output length). A request meets the SLO when its TTFT is
within `--ttft-slo-ms` and its mean gap between tokens within `--itl-slo-ms` (what the
planner's request records show it; the simulated bench judges the same). Reported per arm,
overall and per phase: SLO attainment, goodput, TTFT and ITL p90; the planner's actions
(its lines in the orchestrator's log). With `--sim-profile`, the simulated bench's
prediction for the same phases, arms and SLOs sits beside each (`bench.planner.main`).

Progress on stderr; one JSON document on stdout (and in `--out`). Not a test.
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
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import msgspec

from bench.options import add_model_dir
from bench.planner.main import run_arm as simulate
from bench.planner.sim import Arrival, Phase, PlannerSetup, SimOptions, arrivals
from bench.planner.watch import PlannerWatch, planner_lines, watching
from bench.serve.client import RequestShape, make_client, served_model, stream_request
from bench.serve.prompts import PromptSpec, TokenCounter, build_prompts
from bench.serve.stats import RequestRecord, Slo, distribution_ms
from bench.serve.topology import Topology, stack_definition
from launch.definition import Service
from launch.plan import plan_stack
from launch.stack import LocalStack
from services.orchestrator.planning import Budget, PlannerConfig, Slos, Thresholds
from services.worker.sim.profile import load_profile
from shared.config import WorkerConfig

REQUEST_TIMEOUT_S = 600.0
WARMUP_REQUESTS = 2


def _progress(message: str) -> None:
    print(f"bench_planner_live: {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True, slots=True)
class LiveSetup:
    engine: str
    model_dir: str
    log_root: Path
    slo: Slo
    seed: int = 0
    worker_settings: dict = dataclasses.field(default_factory=dict)
    planner_settings: dict = dataclasses.field(default_factory=dict)
    start_timeout_s: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class Arm:
    name: str
    prefill: int
    decode: int
    planner: bool = False


def planner_settings(slo: Slo, workers: int, *, sustain_s: float, cooldown_s: float) -> dict:
    """The orchestrator's options for the planner arm (`tandem orchestrator --help`)."""
    return {"planner": True, "planner_interval": 1.0, "planner_window": 20.0, "planner_sustain": sustain_s,
            "planner_cooldown": cooldown_s, "planner_max_workers": workers, "ttft_p90_ms": slo.ttft_ms,
            "itl_p90_ms": slo.itl_ms}


def _stack(arm: Arm, setup: LiveSetup) -> LocalStack:
    topology = Topology(name=f"{arm.prefill}p{arm.decode}d", prefill=arm.prefill, decode=arm.decode)
    definition = stack_definition(topology, setup.engine, setup.model_dir, setup.worker_settings)
    if arm.planner:
        definition = msgspec.structs.replace(definition, orchestrator=Service(settings=setup.planner_settings))
    log_dir = setup.log_root / arm.name
    shutil.rmtree(log_dir, ignore_errors=True)
    config = plan_stack(definition, log_dir=str(log_dir), cores=sorted(os.sched_getaffinity(0)),
                        start_timeout_s=setup.start_timeout_s)
    return LocalStack(config)


def prompts_for(requests: list[Arrival], count_tokens: TokenCounter, seed: int) -> list[str]:
    """One prompt per arrival, of its length; none shares a block with another."""
    return [build_prompts(PromptSpec(count=1, prompt_tokens=arrival.prompt_tokens, seed=seed * 1_000_003 + arrival.index),
                          count_tokens)[0] for arrival in requests]


async def drive(stack: LocalStack, requests: list[Arrival], prompts: list[str], warmup: list[str],
                watch: PlannerWatch | None) -> list[RequestRecord]:
    """Warm-up requests one by one, then every arrival at its offset; the records, in arrival order."""
    async with make_client(stack.router_url, REQUEST_TIMEOUT_S) as client, watching(stack, watch):
        model = await served_model(client)

        def shape(max_tokens: int) -> RequestShape:
            return RequestShape(api="completions", model=model, max_tokens=max_tokens,
                                timeout_s=REQUEST_TIMEOUT_S, ignore_eos=True)

        for prompt in warmup:
            await stream_request(client, shape(8), prompt, RequestRecord(sent_at=time.monotonic()))
        records = [RequestRecord(sent_at=0.0) for _ in requests]
        start = time.monotonic()
        if watch is not None:
            watch.started()

        async def send(arrival: Arrival, prompt: str, record: RequestRecord) -> None:
            await asyncio.sleep(max(0.0, start + arrival.at_s - time.monotonic()))
            record.sent_at = time.monotonic()
            await stream_request(client, shape(arrival.output_tokens), prompt, record)

        await asyncio.gather(*(send(arrival, prompt, record)
                               for arrival, prompt, record in zip(requests, prompts, records)))
    return records


def figures(records: list[RequestRecord], slo: Slo, duration_s: float) -> dict:
    done = [record for record in records if record.ok]
    met = sum(slo.met_by(record) for record in records)
    ttft = distribution_ms([record.ttft_s for record in done if record.ttft_s is not None])
    tpot = distribution_ms([record.tpot_s for record in done if record.tpot_s is not None])
    return {"requests": len(records), "completed": len(done), "errors": len(records) - len(done),
            "error_kinds": dict(Counter(record.error or "unfinished" for record in records if not record.ok)),
            "attainment": round(met / len(records), 4) if records else None,
            "goodput_rps": round(met / duration_s, 3), "ttft_p50_ms": ttft["p50"], "ttft_p90_ms": ttft["p90"],
            "itl_p90_ms": tpot["p90"]}


def run_arm(arm: Arm, setup: LiveSetup, plan: list[Phase], requests: list[Arrival], prompts: list[str],
            warmup: list[str]) -> dict:
    stack = _stack(arm, setup)
    _progress(f"{arm.name}: starting {arm.prefill} prefill + {arm.decode} decode {setup.engine} workers"
              + (", planner on" if arm.planner else ""))
    try:
        stack.start()
    except (RuntimeError, TimeoutError) as error:
        _progress(f"{arm.name}: the stack did not start: {error}")
        return {"arm": arm.name, "error": f"stack did not start: {error}"[:500]}
    try:
        started = time.monotonic()
        watch = PlannerWatch() if arm.planner else None
        records = asyncio.run(drive(stack, requests, prompts, warmup, watch))
        wall_s = time.monotonic() - started
    finally:
        stack.stop()
    report = {"arm": arm.name, "start": f"{arm.prefill}p{arm.decode}d", "wall_s": round(wall_s, 1),
              "overall": figures(records, setup.slo, sum(phase.duration_s for phase in plan)),
              "phases": {phase.name: figures([r for r, a in zip(records, requests) if a.phase == phase.name],
                                             setup.slo, phase.duration_s) for phase in plan}}
    if watch is not None:
        report["planner_log"] = planner_lines(setup.log_root / arm.name / "orchestrator.log")
        report["planner_ticks"] = watch.ticks
    overall = report["overall"]
    _progress(f"{arm.name}: attainment {overall['attainment']}, TTFT p90 {overall['ttft_p90_ms']} ms, "
              f"ITL p90 {overall['itl_p90_ms']} ms, {overall['errors']} errors")
    return report


def predicted(arms: list[Arm], plan: list[Phase], setup: LiveSetup, profile: str, sustain_s: float,
              cooldown_s: float) -> list[dict]:
    """The simulated bench's run of the same phases, arms and SLOs on `profile` (simulated time),
    its planner only switching roles, as the live stacks' (their orchestrator has no launcher)."""
    slos = Slos(ttft_p90_ms=setup.slo.ttft_ms, itl_p90_ms=setup.slo.itl_ms)
    options = SimOptions(profile=load_profile(profile), worker=WorkerConfig(worker_id="sim"))
    budget = max(arm.prefill + arm.decode for arm in arms)
    planner = PlannerSetup(slos=slos, interval_s=1.0, window_s=20.0, config=PlannerConfig(
        budget=Budget(max_prefill=budget - 1, max_decode=budget - 1, max_total=budget),
        thresholds=Thresholds(sustain_s=sustain_s), global_cooldown_s=cooldown_s, operator_hold_s=0.0,
        can_add_workers=False))  # as the live stacks' orchestrator: no launcher, so it only switches roles
    out = []
    for arm in arms:
        report = simulate(arm.prefill, arm.decode, plan, setup.seed, options, slos, planner if arm.planner else None)
        out.append({"arm": arm.name, "overall": report["overall"], "phases": report["phases"],
                    "role_switches": report["role_switches"], "actions": report["actions"]})
    return out


def summary(reports: list[dict]) -> dict:
    """The planner's overall attainment over the best static split's."""
    measured = [report for report in reports if "error" not in report]
    static = [report for report in measured if report["arm"] != "planner"]
    planner = next((report for report in measured if report["arm"] == "planner"), None)
    if not static or planner is None:
        return {"error": "an arm has no results"}
    best = max(static, key=lambda report: report["overall"]["attainment"] or 0.0)
    best_attainment = best["overall"]["attainment"] or 0.0
    attainment = planner["overall"]["attainment"] or 0.0
    return {"planner_attainment": attainment, "best_static": best["arm"], "best_static_attainment": best_attainment,
            "ratio": round(attainment / best_attainment, 3) if best_attainment else None,
            "errors": sum(report["overall"]["errors"] for report in measured)}


def _phase(name: str, text: str, duration_s: float) -> Phase:
    try:
        rate, prompt, output = text.split(":")
        return Phase(name, duration_s, rate=float(rate), prompt_tokens=int(prompt), output_tokens=int(output))
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"a phase is RATE:PROMPT_TOKENS:OUTPUT_TOKENS, not {text!r}") from error


def _split(text: str) -> tuple[int, int]:
    prefill, decode = (int(part) for part in text.split(":"))
    if prefill < 1 or decode < 1:
        raise ValueError(f"a split needs a prefill and a decode worker: {text!r}")
    return prefill, decode


def worker_settings(args: argparse.Namespace) -> dict:
    settings = {"vllm_kv_cache_gib": args.vllm_kv_cache_gib}
    if args.vllm_cpu_threads_bind:
        settings["vllm_cpu_threads_bind"] = args.vllm_cpu_threads_bind
    return settings


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem bench planner live", description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="vllm", help="the workers' engine")
    add_model_dir(parser)
    parser.add_argument("--workers", type=int, default=3, help="the budget: prefill + decode workers")
    parser.add_argument("--start", default="1:2", help="the planner's starting split P:D")
    parser.add_argument("--splits", default="", help="static splits P:D,... (default: every split of the budget)")
    parser.add_argument("--phase-s", type=float, default=120.0, help="seconds of each phase")
    parser.add_argument("--decode-phase", default="1.0:64:128", help="RATE:PROMPT:OUTPUT of the decode-heavy phase")
    parser.add_argument("--prefill-phase", default="0.5:1000:16", help="RATE:PROMPT:OUTPUT of the prefill-heavy phase")
    parser.add_argument("--ttft-slo-ms", type=float, default=3000.0)
    parser.add_argument("--itl-slo-ms", type=float, default=150.0)
    parser.add_argument("--sustain-s", type=float, default=8.0, help="the planner's sustain")
    parser.add_argument("--cooldown-s", type=float, default=15.0, help="the planner's global cooldown")
    parser.add_argument("--sim-profile", default="", help="timing profile for the simulated prediction (none: skip)")
    parser.add_argument("--simulate-only", action="store_true", help="only the simulated prediction (no stacks)")
    parser.add_argument("--vllm-kv-cache-gib", type=float, default=0.5)
    parser.add_argument("--vllm-cpu-threads-bind", default="",
                        help="vLLM workers' thread binding (default: one core each, round-robin); 'nobind' with "
                             "OMP_NUM_THREADS=1 lets the OS share the cores among busy engines, so that a role's "
                             "share follows its worker count")
    parser.add_argument("--start-timeout", type=float, default=0.0, help="seconds for a stack to start")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--state-dir", default=".tandem/bench-planner-live", help="logs and the generated model")
    parser.add_argument("--out", default="", help="also write the JSON document here")
    return parser


def _setup(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[LiveSetup, list[Phase], list[Arm]]:
    from shared.tiny_model import model_dir_or_tiny

    try:
        plan = [_phase("decode-heavy", args.decode_phase, args.phase_s),
                _phase("prefill-heavy", args.prefill_phase, args.phase_s)]
        start = _split(args.start)
        splits = [_split(text) for text in args.splits.split(",") if text] or \
            [(p, args.workers - p) for p in range(1, args.workers)]
        slo = Slo(args.ttft_slo_ms, args.itl_slo_ms)
    except (ValueError, argparse.ArgumentTypeError) as error:
        parser.error(str(error))
    if sum(start) != args.workers or any(sum(split) != args.workers for split in splits):
        parser.error(f"every split and --start must add up to --workers ({args.workers})")
    if args.simulate_only and not args.sim_profile:
        parser.error("--simulate-only needs --sim-profile")
    state_dir = Path(args.state_dir)
    model_dir = args.model_dir if args.simulate_only else model_dir_or_tiny(args.model_dir, state_dir)
    setup = LiveSetup(engine=args.engine, model_dir=model_dir, log_root=state_dir / "logs",
                      slo=slo, seed=args.seed, worker_settings=worker_settings(args),
                      planner_settings=planner_settings(slo, args.workers, sustain_s=args.sustain_s,
                                                        cooldown_s=args.cooldown_s),
                      start_timeout_s=args.start_timeout)
    arms = [Arm(f"static {p}p{d}d", p, d) for p, d in splits] + [Arm("planner", *start, planner=True)]
    return setup, plan, arms


def run_live(setup: LiveSetup, plan: list[Phase], arms: list[Arm]) -> list[dict]:
    from bench.serve.run import tokenizer_counter

    requests = arrivals(plan, setup.seed)
    count_tokens = tokenizer_counter(setup.model_dir)
    prompts = prompts_for(requests, count_tokens, setup.seed)
    warmup = build_prompts(PromptSpec(count=WARMUP_REQUESTS, prompt_tokens=64, seed=setup.seed + 999), count_tokens)
    _progress(f"{len(requests)} requests over {len(plan)} phases of {plan[0].duration_s:g} s; arms: "
              + ", ".join(arm.name for arm in arms))
    return [run_arm(arm, setup, plan, requests, prompts, warmup) for arm in arms]


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    setup, plan, arms = _setup(args, parser)
    slo = setup.slo
    document: dict = {"benchmark": "planner-live", "engine": setup.engine, "model_dir": setup.model_dir,
                      "workers": args.workers, "seed": args.seed, "slos": {"ttft_ms": slo.ttft_ms, "itl_ms": slo.itl_ms},
                      "phases": [dataclasses.asdict(phase) for phase in plan],
                      "planner_settings": setup.planner_settings}
    if not args.simulate_only:
        reports = run_live(setup, plan, arms)
        document |= {"summary": summary(reports), "arms": reports}
    if args.sim_profile:
        simulated = predicted(arms, plan, setup, args.sim_profile, args.sustain_s, args.cooldown_s)
        document["simulated"] = {"profile": args.sim_profile, "summary": summary(simulated), "arms": simulated}
    text = json.dumps(document, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0
