"""The soak run's figures and verdict: pure, no I/O, no clock reads.

- memory: per process, RSS at the start, at the end, the maximum, up to 40 samples
  (seconds, MB) to see its shape, and the slope (MB/min)
  of a least-squares line over the second half of the run (the first half is warm-up:
  caches, pools and allocators fill). The slope is judged only when the second half spans
  at least `min_judged_s`; a shorter run says so instead of guessing.
- requests: counts by outcome and by kind, error reasons, latency percentiles of the
  complete answers (send to last byte) and time to first token of the complete streams.
- leftovers: what the workers and the router still hold once the load has stopped and
  they had `settle_s` to finish: leases, used KV blocks, requests.
- verdict: passes when no process grows faster than the bound, no request failed and
  nothing is left over.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bench.soak.client import RequestResult

MB = 1024 * 1024
MAX_RSS_SLOPE_MB_MIN = 2.0
SERIES_POINTS = 40  # RSS samples kept in the document per process (evenly spaced, the last one included)


@dataclass(frozen=True, slots=True)
class Bounds:
    max_rss_slope_mb_min: float = MAX_RSS_SLOPE_MB_MIN  # per process, over the second half
    min_judged_s: float = 60.0  # second halves shorter than this are not judged


@dataclass(frozen=True, slots=True)
class Leftovers:
    leases: dict[str, int]  # per worker
    used_blocks: dict[str, int]
    requests: dict[str, int]  # running + waiting, per worker
    router_in_flight: int | None  # None: the router did not answer
    settle_s: float | None  # how long the stack took to become idle; None: it did not

    @property
    def total(self) -> int:
        return (sum(self.leases.values()) + sum(self.used_blocks.values()) + sum(self.requests.values())
                + (self.router_in_flight or 0))

    def document(self) -> dict:
        return {"leases_held": self.leases, "kv_blocks_used": self.used_blocks, "requests_in_flight": self.requests,
                "router_in_flight": self.router_in_flight, "settled_after_s": self.settle_s, "total": self.total}


def rss_figures(samples: Sequence[tuple[float, int]], duration_s: float, bounds: Bounds) -> dict:
    if not samples:
        return {"samples": 0}
    values = [value for _, value in samples]
    step = max(1, -(-len(samples) // SERIES_POINTS))
    series = [[round(at, 1), round(value / MB, 1)] for at, value in [*samples[:-1:step], samples[-1]]]
    half = duration_s / 2
    second = [(at, value) for at, value in samples if at >= half]
    judged = len(second) >= 3 and second[-1][0] - second[0][0] >= bounds.min_judged_s
    slope = None
    if len(second) >= 2 and second[-1][0] > second[0][0]:
        times = np.array([at for at, _ in second]) / 60.0
        slope = round(float(np.polyfit(times, np.array([value for _, value in second]) / MB, 1)[0]), 3)
    return {"samples": len(samples), "start_mb": round(values[0] / MB, 1), "end_mb": round(values[-1] / MB, 1),
            "max_mb": round(max(values) / MB, 1), "slope_mb_per_min_second_half": slope, "slope_judged": judged,
            "series_s_mb": series}


def percentiles_ms(values_s: Sequence[float]) -> dict:
    if not values_s:
        return {"count": 0, "p50": None, "p99": None, "max": None}
    values = np.asarray(values_s) * 1000.0
    return {"count": len(values_s), "p50": round(float(np.percentile(values, 50)), 2),
            "p99": round(float(np.percentile(values, 99)), 2), "max": round(float(values.max()), 2)}


def request_figures(results: Sequence[RequestResult], duration_s: float) -> dict:
    ok = [result for result in results if result.outcome == "ok"]
    by_kind: dict[str, Counter[str]] = {}
    for result in results:
        by_kind.setdefault(result.kind, Counter())[result.outcome] += 1
    return {
        "total": len(results),
        "by_outcome": dict(Counter(result.outcome for result in results)),
        "by_kind": {kind: dict(counts) for kind, counts in sorted(by_kind.items())},
        "errors": sum(result.outcome == "error" for result in results),
        "error_reasons": dict(Counter(result.error for result in results if result.outcome == "error")),
        "requests_per_s": round(len(results) / duration_s, 2) if duration_s > 0 else None,
        "output_tokens": sum(result.output_tokens for result in ok),
        "latency_ms": percentiles_ms([result.latency_s for result in ok]),
        "ttft_ms": percentiles_ms([result.ttft_s for result in ok if result.ttft_s is not None]),
    }


def verdict(memory: dict[str, dict], requests: dict, leftovers: Leftovers, bounds: Bounds) -> dict:
    reasons = []
    for name, figures in sorted(memory.items()):
        slope = figures.get("slope_mb_per_min_second_half")
        if figures.get("slope_judged") and slope is not None and slope > bounds.max_rss_slope_mb_min:
            reasons.append(f"{name} RSS grows {slope} MB/min (bound {bounds.max_rss_slope_mb_min})")
    if requests["errors"]:
        reasons.append(f"{requests['errors']} requests failed: {requests['error_reasons']}")
    if leftovers.settle_s is None or leftovers.total:
        reasons.append(f"left over after the load stopped: {leftovers.document()}")
    judged = any(figures.get("slope_judged") for figures in memory.values())
    return {"pass": not reasons, "reasons": reasons, "memory_judged": judged,
            "rss_slope_bound_mb_per_min": bounds.max_rss_slope_mb_min}
