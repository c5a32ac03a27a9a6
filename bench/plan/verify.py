"""`tandem plan --verify`: run a split on a real local stack of sim workers with the serving
benchmark's own client and compare what it measures with what the simulator predicted.

The stack is `tandem bench serve`'s (`bench.serve.main.stack_config`: NpMd, every request
disaggregated), its workers on the same timing profile and speed-up as the prediction; the
requests are the benchmark's (same prompt lengths, shared prefix and Poisson instants,
`ignore_eos` so every request makes its full output). Errors are (predicted - measured) /
measured.

The stack's own time (Python, NATS, HTTP: `StackOverheads`) depends on how busy the
machine's CPUs are, so before the measured run the same stack answers a probe: a few
requests of the workload's shape one at a time (no queueing). What its TTFT and inter-token
gap exceed the bare engine time by, over what the overheads predict for it, is the
machine's slowdown factor; `calibrated` predictions scale every real-time overhead by it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import sys
from pathlib import Path

import msgspec

from bench.plan.cluster_sim import ClusterShape, SimSetup, StackOverheads, figures, simulate
from bench.plan.workload import PlanWorkload
from bench.serve.main import CompareSetup, ServeWorkload, run_serve, stack_config, tokenizer_counter
from bench.serve.prompts import PromptSpec
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


PROBE_REQUESTS = 6


def probe_workload(workload: PlanWorkload) -> PlanWorkload:
    """The probe: the workload's lengths, other prompts, one request at a time."""
    return msgspec.structs.replace(workload, num_requests=PROBE_REQUESTS, arrival_rate=0.01, seed=workload.seed + 1)


def slowdown(workload: PlanWorkload, probe: dict, sim_setup: SimSetup) -> float:
    """Measured probe overhead over the overhead `sim_setup` predicts for it (TTFT and ITL p50
    together), clamped to [0.25, 20]."""
    shape = ClusterShape(1, 1)
    quiet = dataclasses.replace(sim_setup, overheads=StackOverheads())
    bare, loaded = (figures(simulate(probe_workload(workload), shape, setup)) for setup in (quiet, sim_setup))
    predicted = sum(loaded[f]["p50"] - bare[f]["p50"] for f in ("ttft_ms", "itl_ms") if bare[f]["p50"] is not None)
    measured = sum(probe[f]["p50"] - bare[f]["p50"] for f in ("ttft_ms", "itl_ms") if bare[f]["p50"] is not None)
    return min(max(measured / predicted, 0.25), 20.0) if predicted > 0 else 1.0


def scaled(overheads: StackOverheads, factor: float) -> StackOverheads:
    fields = msgspec.structs.asdict(overheads)
    return StackOverheads(**{name: value * factor if name.endswith("_ms") else value for name, value in fields.items()})


def measure(workload: PlanWorkload, shape: ClusterShape, setup: VerifySetup) -> tuple[dict, dict]:
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
    probe = dataclasses.replace(serve_workload(probe_workload(workload), setup.warmup), request_rate=None,
                                concurrency=1)
    try:
        _, probed = asyncio.run(run_serve(stack.router_url, probe, count_tokens=count_tokens, label="probe"))
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
