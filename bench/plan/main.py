"""`tandem plan`: capacity planning by simulation.

    tandem plan [--workload FILE.toml] [--arrival-rate 8 --prompt-tokens 1800 --output-tokens 32 ...] \\
        --ttft-slo-ms 500 --itl-slo-ms 25 --max-workers 6 [--sim-profile NAME|FILE] [--json] [--verify]

Simulates every P:D split and worker count within the budget on the sim engine's timing
profile (`bench.plan.cluster_sim`), prints a table (or, with --json, one JSON document) with
predicted TTFT/ITL p50/p90 per split, SLO attainment and the recommended split. --verify
then runs the recommended split on a real local stack of sim workers, probes it for the
machine's slowdown (`bench.plan.probe`), and compares its measured figures with the
prediction under the calibrated overheads (the plain prediction beside it;
`bench.plan.verify`); --verify-out saves that document.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec

from bench.plan.cluster_sim import ClusterShape, SimSetup, StackOverheads, figures, simulate
from bench.plan.sweep import plan
from bench.plan.workload import PlanWorkload, load_workload
from services.orchestrator.planning import Budget, Slos
from services.worker.sim.profile import load_profile

WORKLOAD_FLAGS = {"num_requests": int, "arrival_rate": float, "prompt_tokens": int, "prompt_spread": float,
                  "output_tokens": int, "output_spread": float, "prefix_fraction": float,
                  "shared_prefix_tokens": int, "seed": int}
# What a local stack of sim processes adds to engine time (docs/planner.md: how it was measured)
LOCAL_STACK = StackOverheads(router_ms=10.0, router_chunk_ms=2.0, handoff_ms=30.0, pull_block_ms=1.0, step_ms=2.0, seq_ms=0.2,
                             prefill_token_ms=0.06, textless_share=0.06, hop_jitter_ms=10.0)
OVERHEADS = {"none": StackOverheads(), "local-stack": LOCAL_STACK}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem plan", description=__doc__.splitlines()[0])
    parser.add_argument("--workload", help="TOML file with the workload's keys (flags override them)")
    for name, kind in WORKLOAD_FLAGS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None)
    parser.add_argument("--ttft-slo-ms", type=float, required=True, help="TTFT p90 SLO")
    parser.add_argument("--itl-slo-ms", type=float, required=True, help="ITL p90 SLO")
    parser.add_argument("--max-workers", type=int, default=8, help="worker budget: most workers in all")
    for role in ("prefill", "decode"):
        parser.add_argument(f"--min-{role}", type=int, default=1)
        parser.add_argument(f"--max-{role}", type=int, default=0, help="default: --max-workers - 1")
    parser.add_argument("--sim-profile", default="", help="timing profile: packaged name or file (default: default)")
    parser.add_argument("--sim-speedup", type=float, default=1.0, help="as the workers' --sim-speedup")
    parser.add_argument("--overheads", choices=sorted(OVERHEADS), default="local-stack",
                        help="what the stack adds to engine time")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    parser.add_argument("--verify", action="store_true", help="run the recommended split on a local stack and compare")
    parser.add_argument("--split", default="", help="with --verify: this NpMd split instead of the recommended one")
    parser.add_argument("--verify-out", default="", help="with --verify: also write the JSON document here")
    parser.add_argument("--state-dir", default=".tandem/plan", help="with --verify: logs and the generated model")
    return parser


def _table(document: dict) -> str:
    header = f"{'split':>6} {'ttft p50':>9} {'ttft p90':>9} {'itl p50':>8} {'itl p90':>8} {'attain':>7}  meets"
    lines = [header]
    for row in document["splits"]:
        mark = " *" if row["split"] == document["recommended"]["split"] else ""
        lines.append(f"{row['split']:>6} {row['ttft_p50_ms']:>9.1f} {row['ttft_p90_ms']:>9.1f} "
                     f"{row['itl_p50_ms'] or 0:>8.2f} {row['itl_p90_ms'] or 0:>8.2f} {row['attainment']:>7.1%}  "
                     f"{'yes' if row['meets_slos'] else 'no'}{mark}")
    lines.append(f"recommended: {document['why']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    overrides = {name: getattr(args, name) for name in WORKLOAD_FLAGS}
    try:
        workload = load_workload(args.workload, **overrides) if args.workload else PlanWorkload(
            **{name: value for name, value in overrides.items() if value is not None})
        workload.validate()
        budget = Budget(min_prefill=args.min_prefill, max_prefill=args.max_prefill or args.max_workers - 1,
                        min_decode=args.min_decode, max_decode=args.max_decode or args.max_workers - 1,
                        max_total=args.max_workers)
        setup = SimSetup(profile=load_profile(args.sim_profile), speedup=args.sim_speedup,
                         overheads=OVERHEADS[args.overheads])
        slos = Slos(ttft_p90_ms=args.ttft_slo_ms, itl_p90_ms=args.itl_slo_ms)
        document = plan(workload, slos, budget, setup)
    except (ValueError, OSError) as error:  # ConfigError is a ValueError
        parser.error(str(error))
    if args.verify:
        document = _verify(args, workload, setup, document)
    if args.json or args.verify:
        json.dump(document, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(_table(document))
    return 0 if not args.verify or document["verify"]["all_within"] else 1


def _verify(args: argparse.Namespace, workload: PlanWorkload, setup: SimSetup, document: dict) -> dict:
    import dataclasses

    from bench.plan.probe import calibrated, slowdown
    from bench.plan.verify import VerifySetup, compare, measure
    from bench.serve.topology import parse_topology

    chosen = document["recommended"]["split"] if not args.split else parse_topology(args.split).name
    topology = parse_topology(chosen)
    shape = ClusterShape(prefill=topology.prefill, decode=topology.decode)
    probe, measured = measure(workload, shape, VerifySetup(state_dir=Path(args.state_dir), profile=args.sim_profile,
                                                           sim_speedup=args.sim_speedup))
    factors = slowdown(workload, probe, setup)
    calibrated_setup = dataclasses.replace(setup, overheads=calibrated(setup.overheads, factors))
    predicted = figures(simulate(workload, shape, setup))
    predicted_calibrated = figures(simulate(workload, shape, calibrated_setup))
    document["verify"] = {"split": shape.name, **compare(predicted_calibrated, measured, 0.25),
                          "predicted": predicted_calibrated, "measured": measured,
                          "probe": {"figures": probe, "slowdown": {key: round(value, 3) for key, value in factors.items()},
                                    "calibrated_overheads": msgspec.to_builtins(calibrated_setup.overheads)},
                          "plain": {**compare(predicted, measured, 0.25), "predicted": predicted}}
    if args.verify_out:
        Path(args.verify_out).write_text(json.dumps(document, indent=1) + "\n")
    return document


if __name__ == "__main__":
    sys.exit(main())
