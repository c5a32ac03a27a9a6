"""Figures of `tandem bench router` from its phase runs: pure, no I/O, no clock reads.

Per phase run: requests/s (successful requests over the phase's duration), end-to-end
latency p50/p99 (send to the stream's end, successful requests), router CPU-µs per request
(the router processes' CPU time over the phase, divided by the requests sent). Per system
and figure: the median and the spread (min, max) over rounds. Per round and figure: the
ratio Tandem/Dynamo, then its median and spread over rounds.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import numpy as np

from bench.router.load import PhaseRun

FIGURES = ("requests_per_s", "p50_ms", "p99_ms", "router_cpu_us_per_request")


def phase_figures(run: PhaseRun) -> dict:
    ok = [record for record in run.records if record.ok]
    latencies_ms = [record.e2e_s * 1000.0 for record in ok if record.e2e_s is not None]
    sent = len(run.records)
    return {
        "requests": sent,
        "errors": sent - len(ok),
        "duration_s": round(run.duration_s, 3),
        "requests_per_s": round(len(ok) / run.duration_s, 1) if run.duration_s > 0 else 0.0,
        "p50_ms": _percentile(latencies_ms, 50),
        "p99_ms": _percentile(latencies_ms, 99),
        "router_cpu_us_per_request": round(run.router_cpu_s * 1e6 / sent, 1) if sent else None,
    }


def _percentile(values: Sequence[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 2) if values else None


def spread(values: Sequence[float | None]) -> dict:
    known = [value for value in values if value is not None]
    if not known:
        return {"median": None, "min": None, "max": None, "rounds": len(values)}
    return {"median": round(statistics.median(known), 3), "min": round(min(known), 3),
            "max": round(max(known), 3), "rounds": len(known)}


def system_summary(rounds: Sequence[dict], system: str) -> dict:
    """Per phase and figure, the spread over the rounds that ran `system`."""
    phases = [phase for phase in rounds[0].get(system, {})] if rounds else []
    return {phase: {figure: spread([one[system][phase][figure] for one in rounds if system in one])
                    for figure in FIGURES} for phase in phases}


def ratios(rounds: Sequence[dict], numerator: str = "tandem", denominator: str = "dynamo") -> dict:
    """Per phase and figure: `numerator / denominator` round by round, and its spread."""
    both = [one for one in rounds if numerator in one and denominator in one]
    if not both:
        return {}
    result: dict = {}
    for phase in both[0][numerator]:
        result[phase] = {}
        for figure in FIGURES:
            per_round = [_ratio(one[numerator][phase][figure], one[denominator][phase][figure]) for one in both]
            result[phase][figure] = {**spread(per_round), "per_round": per_round}
    return result


def _ratio(top: float | None, bottom: float | None) -> float | None:
    if top is None or not bottom:
        return None
    return round(top / bottom, 3)


def goals(ratio_figures: dict) -> dict:
    """The router's targets: at least Dynamo's requests/s, at most its sequential p50."""
    if not ratio_figures:
        return {}
    throughput = ratio_figures["concurrent"]["requests_per_s"]["median"]
    sequential_p50 = ratio_figures["sequential"]["p50_ms"]["median"]
    return {"requests_per_s_at_least_dynamo": throughput is not None and throughput >= 1.0,
            "sequential_p50_at_most_dynamo": sequential_p50 is not None and sequential_p50 <= 1.0}
