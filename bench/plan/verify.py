"""`tandem plan --verify`: run a split on a real local stack of sim workers with the serving
benchmark's own client and compare what it measures with what the simulator predicted.

The stack is `tandem bench serve`'s (`bench.serve.main.stack_config`: NpMd, every request
disaggregated), its workers on the same timing profile and speed-up as the prediction; the
requests are the benchmark's (same prompt lengths, shared prefix and Poisson instants,
`ignore_eos` so every request makes its full output). Errors are (predicted - measured) /
measured.

The stack's own time depends on how busy the machine's CPUs are, so before the measured run
the same stack answers a probe (`bench.plan.probe`) that gives the calibrated overheads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import sys
from pathlib import Path

from bench.plan.cluster_sim import ClusterShape
from bench.plan.probe import run_probe
from bench.plan.workload import PlanWorkload
from bench.serve.main import CompareSetup, stack_config
from bench.serve.prompts import PromptSpec
from bench.serve.run import ServeWorkload, run_serve, tokenizer_counter
from bench.serve.topology import Topology
from launch.stack import LocalStack

COMPARED = (("ttft_ms", "p50"), ("ttft_ms", "p90"), ("itl_ms", "p50"), ("itl_ms", "p90"))


@dataclasses.dataclass(frozen=True, slots=True)
class VerifySetup:
    state_dir: Path
    profile: str = ""
    sim_speedup: float = 1.0
    warmup: int = 2
    tolerance: float = 0.25


def serve_workload(workload: PlanWorkload, warmup: int) -> ServeWorkload:
    """The benchmark's form of `workload`; ValueError for what the benchmark cannot send."""
    if workload.prompt_spread or workload.output_spread or workload.prefix_fraction not in (0.0, 1.0):
        raise ValueError("--verify needs fixed lengths and a prefix_fraction of 0 or 1 (the benchmark's prompts)")
    shared = workload.shared_prefix_tokens if workload.prefix_fraction else 0
    return ServeWorkload(prompts=PromptSpec(count=workload.num_requests, prompt_tokens=workload.prompt_tokens,
                                            shared_prefix_tokens=shared, seed=workload.seed),
                         max_tokens=workload.output_tokens, request_rate=workload.arrival_rate, warmup=warmup,
                         ignore_eos=True)


def measure(workload: PlanWorkload, shape: ClusterShape, setup: VerifySetup) -> tuple[dict[str, float], dict]:
    """The probe's figures and the workload's, on one fresh stack of `shape`."""
    from shared.tiny_model import ensure_tiny_model

    model_dir = ensure_tiny_model(str(setup.state_dir / "models" / "tiny"))
    settings = {"sim_profile": setup.profile} if setup.profile else {}
    compare_setup = CompareSetup(engine="sim", model_dir=model_dir, log_root=setup.state_dir / "logs",
                                 sim_speedup=setup.sim_speedup, worker_settings=settings)
    topology = Topology(name=shape.name, prefill=shape.prefill, decode=shape.decode)
    config = stack_config(compare_setup, topology)
    shutil.rmtree(config.log_dir, ignore_errors=True)
    print(f"plan verify: starting {shape.name}", file=sys.stderr, flush=True)
    stack = LocalStack(config)
    stack.start()
    count_tokens = tokenizer_counter(model_dir)
    try:
        probed = run_probe(stack.router_url, workload, count_tokens, setup.warmup)
        _, results = asyncio.run(run_serve(stack.router_url, serve_workload(workload, 0),
                                           count_tokens=count_tokens, label=shape.name))
    finally:
        stack.stop()
    return probed, results


def compare(predicted: dict, measured: dict, tolerance: float) -> dict:
    rows = {}
    for figure, key in COMPARED:
        want, got = predicted[figure][key], measured[figure][key]
        error = (want - got) / got if want is not None and got else None
        rows[f"{figure.removesuffix('_ms')}_{key}"] = {
            "predicted_ms": want, "measured_ms": got, "error": round(error, 4) if error is not None else None,
            "within": error is not None and abs(error) <= tolerance}
    return {"figures": rows, "all_within": all(row["within"] for row in rows.values()), "tolerance": tolerance,
            "measured_errors": measured.get("errors"), "measured_completed": measured.get("completed")}
