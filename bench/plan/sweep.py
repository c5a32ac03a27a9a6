"""Every P:D split within a worker budget, simulated, and the recommendation (pure).

A split meets the SLOs when its predicted TTFT p90 and ITL p90 are both within them.
Attainment is the share of requests that meet both on their own (their TTFT, and the p90
of their own inter-token gaps). The recommendation is the split with the fewest workers that
meets the SLOs, ties broken by attainment, then by TTFT p90; when none does, the one with
the best attainment, said so.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np

from bench.plan.cluster_sim import ClusterShape, RequestTrace, SimSetup, figures, simulate
from bench.plan.workload import PlanWorkload
from services.orchestrator.planning import Budget, Slos
from services.orchestrator.planning.whatif import SplitPrediction


@dataclass(frozen=True, slots=True)
class SplitResult:
    shape: ClusterShape
    figures: dict
    attainment: float
    meets_slos: bool

    def row(self) -> dict:
        ttft, itl = self.figures["ttft_ms"], self.figures["itl_ms"]
        return {"split": self.shape.name, "prefill": self.shape.prefill, "decode": self.shape.decode,
                "workers": self.shape.total, "ttft_p50_ms": ttft["p50"], "ttft_p90_ms": ttft["p90"],
                "itl_p50_ms": itl["p50"], "itl_p90_ms": itl["p90"], "e2e_p90_ms": self.figures["e2e_ms"]["p90"],
                "attainment": round(self.attainment, 4), "meets_slos": self.meets_slos}


def shapes(budget: Budget) -> list[ClusterShape]:
    return [ClusterShape(prefill, total - prefill)
            for total in range(2, budget.max_total + 1)
            for prefill in range(budget.min_prefill, min(budget.max_prefill, total - 1) + 1)
            if budget.min_decode <= total - prefill <= budget.max_decode]


def attainment(traces: list[RequestTrace], slos: Slos) -> float:
    def ok(trace: RequestTrace) -> bool:
        gaps = trace.itl_s
        return bool(trace.token_at) and trace.ttft_s * 1000 <= slos.ttft_p90_ms and (
            not gaps or float(np.percentile(gaps, 90)) * 1000 <= slos.itl_p90_ms)

    return sum(ok(trace) for trace in traces) / len(traces) if traces else 0.0


def evaluate(workload: PlanWorkload, shape: ClusterShape, slos: Slos, setup: SimSetup) -> SplitResult:
    traces = simulate(workload, shape, setup)
    result = figures(traces)
    meets = result["ttft_ms"]["p90"] <= slos.ttft_p90_ms and (result["itl_ms"]["p90"] or 0.0) <= slos.itl_p90_ms
    return SplitResult(shape=shape, figures=result, attainment=attainment(traces, slos), meets_slos=meets)


def recommend(results: list[SplitResult]) -> tuple[SplitResult, str]:
    meeting = [result for result in results if result.meets_slos]
    if meeting:
        best = min(meeting, key=lambda r: (r.shape.total, -r.attainment, r.figures["ttft_ms"]["p90"]))
        return best, f"{best.shape.name}: the fewest workers ({best.shape.total}) that meet the SLOs"
    best = max(results, key=lambda r: (r.attainment, -r.shape.total))
    return best, f"no split within the budget meets the SLOs; {best.shape.name} has the best attainment"


def plan(workload: PlanWorkload, slos: Slos, budget: Budget, setup: SimSetup) -> dict:
    results = [evaluate(workload, shape, slos, setup) for shape in shapes(budget)]
    if not results:
        raise ValueError("the budget allows no split with a prefill and a decode worker")
    best, why = recommend(results)
    return {"workload": msgspec.to_builtins(workload), "slos": msgspec.to_builtins(slos),
            "budget": msgspec.to_builtins(budget), "profile": setup.profile.name, "sim_speedup": setup.speedup,
            "overheads": msgspec.to_builtins(setup.overheads),
            "splits": [result.row() for result in results],
            "recommended": best.row(), "why": why}


class SimWhatIf:
    """`services.orchestrator.planning.whatif.WhatIfModel` backed by the cluster simulator."""

    def __init__(self, workload: PlanWorkload, slos: Slos, setup: SimSetup) -> None:
        self.workload, self.slos, self.setup = workload, slos, setup

    def predict(self, prefill: int, decode: int) -> SplitPrediction:
        row = evaluate(self.workload, ClusterShape(prefill, decode), self.slos, self.setup).row()
        return SplitPrediction(prefill=prefill, decode=decode, attainment=row["attainment"],
                               **{key: row[key] or 0.0 for key in ("ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms",
                                                                    "itl_p90_ms")})
