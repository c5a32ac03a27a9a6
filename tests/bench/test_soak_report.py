"""The soak benchmark's pure parts: the seeded workload mix, and the figures and verdict
computed from plain records."""

from __future__ import annotations

import pytest

from bench.soak.client import RequestResult
from bench.soak.report import Bounds, Leftovers, request_figures, rss_figures, verdict
from bench.soak.workload import RequestMaker, WorkloadMix

MB = 1024 * 1024
CLEAN = Leftovers(leases={"d1": 0}, used_blocks={"d1": 0}, requests={"d1": 0}, router_in_flight=0, settle_s=0.3)


def test_the_workload_is_seeded_and_mixed() -> None:
    first = [RequestMaker(7).next() for _ in range(1)]
    maker, again = RequestMaker(7), RequestMaker(7)
    drawn = [maker.next() for _ in range(2000)]
    assert drawn == [again.next() for _ in range(2000)] and drawn[0] == first[0]
    assert drawn != [RequestMaker(8).next() for _ in range(2000)]
    kinds = {request.kind for request in drawn}
    assert kinds == {"chat-stream", "chat-whole", "completions-stream", "completions-whole"}
    cancels = [request for request in drawn if request.cancels]
    assert 0.05 < len(cancels) / len(drawn) < 0.15
    assert all((request.cancel_after_chunks is not None) == request.stream for request in cancels)
    shared = [request for request in drawn if request.shared_prefix is not None]
    assert 0.4 < len(shared) / len(drawn) < 0.6
    assert all(request.prompt.startswith(maker.prefixes[request.shared_prefix]) for request in shared)
    lengths = [len(request.prompt.split()) for request in drawn]
    assert min(lengths) <= 10 and max(lengths) >= 300
    assert all(1 <= request.max_tokens <= 128 for request in drawn)


def test_a_bad_mix_is_refused() -> None:
    with pytest.raises(ValueError):
        WorkloadMix(cancel_fraction=1.5)
    with pytest.raises(ValueError):
        WorkloadMix(max_tokens=(0, 4))


def test_rss_slope_is_taken_over_the_second_half_and_judged_only_when_long_enough() -> None:
    # 100 MB flat for 5 minutes after a warm-up climb in the first half: no slope
    samples = [(float(t), (50 + min(t, 100) // 2) * MB) for t in range(0, 600, 5)]
    flat = rss_figures(samples, 600, Bounds())
    assert flat["start_mb"] == 50 and flat["max_mb"] == 100 and flat["slope_mb_per_min_second_half"] == 0
    assert flat["slope_judged"] is True
    assert len(flat["series_s_mb"]) <= 41 and flat["series_s_mb"][0] == [0.0, 50.0]
    assert flat["series_s_mb"][-1] == [595.0, 100.0]
    growing = rss_figures([(float(t), (100 * MB + t * MB // 20)) for t in range(0, 600, 5)], 600, Bounds())
    assert growing["slope_mb_per_min_second_half"] == pytest.approx(3.0, abs=0.01)
    short = rss_figures(samples[:8], 40, Bounds())
    assert short["slope_judged"] is False


def test_the_verdict_names_growth_errors_and_leftovers() -> None:
    results = [RequestResult(kind="chat-stream", outcome="ok", sent_at=0.0, ended_at=0.2, ttft_s=0.05),
               RequestResult(kind="chat-whole", outcome="cancelled", sent_at=0.0, ended_at=0.1),
               RequestResult(kind="chat-whole", outcome="error", sent_at=0.0, ended_at=1.0, error="timeout")]
    requests = request_figures(results, 10.0)
    assert requests["by_outcome"] == {"ok": 1, "cancelled": 1, "error": 1} and requests["errors"] == 1
    assert requests["error_reasons"] == {"timeout": 1} and requests["latency_ms"]["p50"] == 200.0
    grows = {"router": {"slope_mb_per_min_second_half": 5.0, "slope_judged": True}}
    held = Leftovers(leases={"p1": 1}, used_blocks={"p1": 2}, requests={"p1": 0}, router_in_flight=0, settle_s=None)
    failed = verdict(grows, requests, held, Bounds())
    assert failed["pass"] is False and len(failed["reasons"]) == 3
    clean = request_figures(results[:2], 10.0)
    assert verdict({"router": {"slope_mb_per_min_second_half": 5.0, "slope_judged": False}}, clean, CLEAN,
                   Bounds())["pass"] is True
