"""`tandem bench planner`: the SLO planner against static prefill/decode splits (JSON).

    tandem bench planner [--workers 4] [--phase-s 300] [--seed 0] [--ttft-slo-ms 1000]
        [--itl-slo-ms 20] [--splits 1:3,2:2,3:1] [--no-phase-check] [--out FILE]

One seeded workload whose mix shifts, phase by phase, each phase needing its own split of
the budget (4 sim workers): prefill-heavy (long prompts, short outputs: 3p1d), decode-heavy
(short prompts, long outputs: 1p3d), mixed (2p2d). Every arm sees the same arrivals on the
same budget of sim workers (`bench.planner.sim`, the sim engine's timing profile, in
simulated time): each static split, and the planner starting from an even split. Reported
per phase (by arrival) and overall: SLO attainment (a request meets both TTFT <= SLO and its
mean inter-token gap <= SLO), goodput (requests meeting both per second of the phase), TTFT
and ITL p90; per arm: the planner's actions with their reasons, role switches and
worker-seconds. `phase_check`: every static split on each phase alone (an empty cluster at
its start), which shows that the budget can meet every phase with the right split and which
split that is. `summary`: the best static split, the planner's ratio to it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from bench.planner.sim import Outcome, Phase, PlannedCluster, PlannerSetup, SimOptions, arrivals
from services.orchestrator.planner_inputs import p90
from services.orchestrator.planning import Budget, PlannerConfig, Slos, Thresholds
from services.worker.sim.profile import load_profile
from shared.config import WorkerConfig


def phases(phase_s: float) -> list[Phase]:
    """Sized for 4 workers of the default profile and worker config (prefill ~19k tok/s per
    worker on 512-token chunks; a decode worker's KV holds 16k tokens):

    - prefill-heavy: 45k prompt tok/s: 3 prefill workers at 0.78 of capacity, 2 at 1.17;
      decode is light (8 tokens each), one worker holds it;
    - decode-heavy: 12 req/s of 512 tokens: 3 decode workers hold ~23 sequences each
      (~60 % of their KV), 2 would need ~40 each (their KV is full: a queue grows); prefill is
      light (1.5k tok/s);
    - mixed: 26k prompt tok/s (1 prefill worker at 1.36, 2 at 0.68) and 34 req/s of 64
      tokens with 768-token prompts (1 decode worker's KV is full at ~20 sequences: 1.2x
      over; 2 hold ~11 each, ~55 % of their KV).
    """
    return [Phase("prefill-heavy", phase_s, rate=22.0, prompt_tokens=2048, output_tokens=8),
            Phase("decode-heavy", phase_s, rate=12.0, prompt_tokens=128, output_tokens=512),
            Phase("mixed", phase_s, rate=34.0, prompt_tokens=768, output_tokens=64)]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem bench planner", description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4, help="the budget: prefill + decode workers")
    parser.add_argument("--phase-s", type=float, default=300.0, help="seconds of each phase (simulated)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    parser.add_argument("--itl-slo-ms", type=float, default=20.0)
    parser.add_argument("--splits", default="", help="static splits as P:D,...; default: every split of the budget")
    parser.add_argument("--sustain-s", type=float, default=6.0)
    parser.add_argument("--cooldown-s", type=float, default=10.0)
    parser.add_argument("--start-s", type=float, default=5.0, help="a scaled-up worker's start-up")
    parser.add_argument("--prefill-capacity-tok-s", type=float, default=None,
                        help="the planner's prefill capacity per worker; default: the profile's on full chunks, "
                             "0: unknown")
    parser.add_argument("--sim-profile", default="", help="timing profile: packaged name or file")
    parser.add_argument("--no-phase-check", action="store_true", help="skip each split on each phase alone")
    parser.add_argument("--out", default="", help="also write the JSON document here")
    return parser


def prefill_capacity(options: SimOptions) -> float:
    """One worker's prefill throughput on full chunks (tok/s): what an operator measures and
    configures (`PlannerLoopConfig.prefill_capacity_tok_s`)."""
    chunk = options.worker.max_num_batched_tokens
    return chunk / options.profile.step_duration_s(prefill_tokens=chunk, decode_seqs=0)


def _meets(outcome: Outcome, slos: Slos) -> bool:
    return bool(outcome.token_at) and outcome.ttft_s * 1000 <= slos.ttft_p90_ms \
        and outcome.itl_s * 1000 <= slos.itl_p90_ms


def _figures(outcomes: list[Outcome], slos: Slos, duration_s: float) -> dict:
    done = [o for o in outcomes if o.token_at]
    met = sum(_meets(o, slos) for o in outcomes)
    return {"requests": len(outcomes), "completed": len(done), "errors": len(outcomes) - len(done),
            "attainment": round(met / len(outcomes), 4) if outcomes else None,
            "goodput_rps": round(met / duration_s, 3),
            "ttft_p90_ms": round(p90([o.ttft_s * 1000 for o in done]), 1),
            "itl_p90_ms": round(p90([o.itl_s * 1000 for o in done if len(o.token_at) > 1]), 2)}


def run_arm(prefill: int, decode: int, plan: list[Phase], seed: int, options: SimOptions, slos: Slos,
            planner: PlannerSetup | None) -> dict:
    cluster = PlannedCluster(prefill, decode, options, planner)
    outcomes = cluster.run(arrivals(plan, seed))
    report: dict = {"arm": "planner" if planner is not None else f"static {prefill}p{decode}d",
                    "start": f"{prefill}p{decode}d",
                    "overall": _figures(outcomes, slos, sum(phase.duration_s for phase in plan)),
                    "phases": {phase.name: _figures([o for o in outcomes if o.arrival.phase == phase.name], slos,
                                                    phase.duration_s) for phase in plan},
                    "worker_seconds": round(cluster.worker_seconds(), 1),
                    "role_switches": sum(1 for a in cluster.actions if a["action"] == "SwitchRole"),
                    "actions": cluster.actions}
    return report


def phase_check(splits: list[tuple[int, int]], plan: list[Phase], seed: int, options: SimOptions,
                slos: Slos) -> dict:
    """Each split's attainment on each phase alone: {phase: {"1p3d": 0.99, ...}}."""
    return {phase.name: {f"{p}p{d}d": _figures(PlannedCluster(p, d, options, None).run(arrivals([phase], seed)),
                                               slos, phase.duration_s)["attainment"] for p, d in splits}
            for phase in plan}


def summary(arms: list[dict]) -> dict:
    static = [arm for arm in arms if arm["arm"] != "planner"]
    planner = next(arm for arm in arms if arm["arm"] == "planner")
    best = max(static, key=lambda arm: arm["overall"]["attainment"] or 0.0)
    best_attainment = best["overall"]["attainment"] or 0.0
    attainment = planner["overall"]["attainment"] or 0.0
    return {"planner_attainment": attainment, "best_static": best["arm"], "best_static_attainment": best_attainment,
            "ratio": round(attainment / best_attainment, 3) if best_attainment else None,
            "errors": sum(arm["overall"]["errors"] for arm in arms),
            "planner_role_switches": planner["role_switches"], "planner_worker_seconds": planner["worker_seconds"],
            "best_static_worker_seconds": best["worker_seconds"]}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["live"]:  # the same question on real engines, in real time (bench.planner.live)
        from bench.planner.live import main as live_main

        return live_main(argv[1:])
    args = _parser().parse_args(argv)
    budget = args.workers
    if budget < 2:
        print("the budget needs 2 workers or more", file=sys.stderr)
        return 2
    splits = [tuple(int(n) for n in split.split(":")) for split in args.splits.split(",") if split] \
        or [(p, budget - p) for p in range(1, budget)]
    slos = Slos(ttft_p90_ms=args.ttft_slo_ms, itl_p90_ms=args.itl_slo_ms)
    options = SimOptions(profile=load_profile(args.sim_profile), worker=WorkerConfig(worker_id="sim"))
    capacity = args.prefill_capacity_tok_s if args.prefill_capacity_tok_s is not None \
        else prefill_capacity(options)
    planner = PlannerSetup(slos=slos, start_s=args.start_s, prefill_capacity_tok_s=capacity, config=PlannerConfig(
        budget=Budget(max_prefill=budget - 1, max_decode=budget - 1, max_total=budget),
        thresholds=Thresholds(sustain_s=args.sustain_s), global_cooldown_s=args.cooldown_s,
        worker_cooldown_s=3 * args.cooldown_s, operator_hold_s=0.0))
    plan = phases(args.phase_s)
    arms = [run_arm(p, d, plan, args.seed, options, slos, None) for p, d in splits]
    arms.append(run_arm(budget // 2, budget - budget // 2, plan, args.seed, options, slos, planner))
    document = {"benchmark": "planner", "simulated": True, "profile": options.profile.name, "workers": budget,
                "seed": args.seed, "slos": {"ttft_ms": slos.ttft_p90_ms, "itl_ms": slos.itl_p90_ms},
                "phases": [{"name": p.name, "duration_s": p.duration_s, "rate": p.rate,
                            "prompt_tokens": p.prompt_tokens, "output_tokens": p.output_tokens} for p in plan],
                "planner": {"interval_s": planner.interval_s, "window_s": planner.window_s,
                            "sustain_s": args.sustain_s, "cooldown_s": args.cooldown_s, "start_s": planner.start_s,
                            "prefill_capacity_tok_s": round(capacity, 1)},
                "summary": summary(arms),
                "phase_check": None if args.no_phase_check else phase_check(splits, plan, args.seed, options, slos),
                "arms": arms}
    text = json.dumps(document, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as file:
            file.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
