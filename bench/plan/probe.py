"""The stack's slowdown, measured on the stack itself (pure apart from `run_probe`).

The real time the stack adds (`StackOverheads`: Python, NATS, HTTP, KV pulls) grows with how
busy the machine's CPUs are. Before a verification run the same fresh stack answers a probe:
`PROBE_REQUESTS` requests of the workload's lengths (other prompts), one at a time, so
nothing queues. Against the bare engine time the simulator gives for the same probe:

- the general factor: measured (TTFT p50 + later gaps p50) overhead over the overhead the
  configured `StackOverheads` predict;
- the transfer factor: the same for the first inter-token gap, which holds the hand-off and
  the KV pull (reported only).

`calibrated` scales every overhead but the hand-off and pull by the general factor. Those two
stay as fitted: a lone request's hand-off shows nothing of the stalls that pulls cause on a
decode worker busy with other sequences while prefill workers compute beside it, which is
what `pull_block_ms` stands for (scaling them by the transfer factor made ITL p90 26 to 42 %
low on the prefill-heavy runs: docs/planner.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
from collections.abc import Sequence
from typing import Protocol

import msgspec

from bench.plan.cluster_sim import ClusterShape, SimSetup, StackOverheads, simulate
from bench.plan.workload import PlanWorkload

PROBE_REQUESTS = 6
TRANSFER_FIELDS = ("handoff_ms", "pull_block_ms")


class Timed(Protocol):
    @property
    def ttft_s(self) -> float | None: ...

    @property
    def itl_s(self) -> list[float]: ...


def probe_workload(workload: PlanWorkload) -> PlanWorkload:
    """The probe: the workload's lengths, other prompts, one request at a time (by rate for the
    simulator; the benchmark sends them in a closed loop of one)."""
    return msgspec.structs.replace(workload, num_requests=PROBE_REQUESTS, arrival_rate=0.01, seed=workload.seed + 1)


def probe_figures(requests: Sequence[Timed]) -> dict[str, float]:
    """Medians in ms: TTFT, the first inter-token gap, the later gaps."""
    firsts = [request.itl_s[0] for request in requests if request.itl_s]
    later = [gap for request in requests for gap in request.itl_s[1:]]
    return {"ttft_ms": 1000 * statistics.median(request.ttft_s or 0.0 for request in requests),
            "first_gap_ms": 1000 * statistics.median(firsts) if firsts else 0.0,
            "gap_ms": 1000 * statistics.median(later) if later else 0.0}


def _ratio(measured: float, predicted: float) -> float:
    return min(max(measured / predicted, 0.25), 20.0) if predicted > 0 else 1.0


def slowdown(workload: PlanWorkload, measured: dict[str, float], setup: SimSetup) -> dict[str, float]:
    """The general and transfer factors of the probe's `measured` figures."""
    shape = ClusterShape(1, 1)
    bare_setup = dataclasses.replace(setup, overheads=StackOverheads())
    bare, loaded = (probe_figures(simulate(probe_workload(workload), shape, each)) for each in (bare_setup, setup))
    general = ("ttft_ms", "gap_ms")
    return {"general": _ratio(sum(measured[key] - bare[key] for key in general),
                              sum(loaded[key] - bare[key] for key in general)),
            "transfer": _ratio(measured["first_gap_ms"] - bare["first_gap_ms"],
                               loaded["first_gap_ms"] - bare["first_gap_ms"])}


def calibrated(overheads: StackOverheads, factors: dict[str, float]) -> StackOverheads:
    fields = msgspec.structs.asdict(overheads)
    return StackOverheads(**{
        name: value * factors["general"] if name.endswith("_ms") and name not in TRANSFER_FIELDS else value
        for name, value in fields.items()})


def run_probe(url: str, workload: PlanWorkload, count_tokens, warmup: int) -> dict[str, float]:
    """Send the probe to the stack at `url`; its figures."""
    from bench.plan.verify import serve_workload
    from bench.serve.client import LoadPlan, RequestShape, make_client, run_requests, served_model
    from bench.serve.prompts import build_prompts

    spec = serve_workload(probe_workload(workload), warmup)
    prompts = build_prompts(dataclasses.replace(spec.prompts, count=spec.prompts.count + warmup), count_tokens)

    async def probe() -> dict[str, float]:
        async with make_client(url, spec.timeout_s) as client:
            shape = RequestShape(api=spec.api, model=await served_model(client), max_tokens=spec.max_tokens,
                                 timeout_s=spec.timeout_s, ignore_eos=True)
            await run_requests(client, shape, prompts[PROBE_REQUESTS:], LoadPlan(concurrency=1))  # warm-up
            records, _ = await run_requests(client, shape, prompts[:PROBE_REQUESTS], LoadPlan(concurrency=1))
        return probe_figures([record for record in records if record.ok])

    return asyncio.run(probe())
