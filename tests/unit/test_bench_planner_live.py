"""The pure parts of `tandem bench planner live`: its phases, prompts, figures and summary."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.planner.live import _phase, figures, main, prompts_for, summary
from bench.planner.sim import Phase, arrivals
from bench.planner.watch import planner_lines
from bench.serve.stats import RequestRecord, Slo


def record(ttft_s: float, gap_s: float, tokens: int, *, error: str | None = None) -> RequestRecord:
    chunks = [10.0 + ttft_s + index * gap_s for index in range(tokens)]
    return RequestRecord(sent_at=10.0, text_chunk_at=chunks, ended_at=chunks[-1], output_tokens=tokens, error=error)


def test_phase_text_is_rate_prompt_output() -> None:
    assert _phase("decode-heavy", "1.5:64:128", 60.0) == Phase("decode-heavy", 60.0, rate=1.5, prompt_tokens=64,
                                                                output_tokens=128)
    with pytest.raises(argparse.ArgumentTypeError):
        _phase("decode-heavy", "1.5:64", 60.0)


def test_each_arrival_gets_a_prompt_of_its_length_and_none_repeats() -> None:
    requests = arrivals([Phase("a", 20.0, rate=1.0, prompt_tokens=30, output_tokens=4)], seed=3)
    prompts = prompts_for(requests, lambda piece: 1, seed=3)
    assert len(prompts) == len(requests) > 5
    assert [len(prompt.split()) for prompt in prompts] == [arrival.prompt_tokens for arrival in requests]
    assert len({tuple(prompt.split()[:8]) for prompt in prompts}) == len(prompts)
    assert prompts_for(requests, lambda piece: 1, seed=3) == prompts


def test_a_request_meets_the_slo_on_both_ttft_and_its_mean_gap() -> None:
    slo = Slo(ttft_ms=1000, itl_ms=100)
    records = [record(0.5, 0.05, 10), record(1.5, 0.05, 10), record(0.5, 0.2, 10), record(0.5, 0.05, 10, error="x")]
    result = figures(records, slo, duration_s=2.0)
    assert (result["requests"], result["completed"], result["errors"]) == (4, 3, 1)
    assert result["attainment"] == 0.25 and result["goodput_rps"] == 0.5


def test_summary_compares_the_planner_with_the_best_static_split() -> None:
    def arm(name: str, attainment: float) -> dict:
        return {"arm": name, "overall": {"attainment": attainment, "errors": 0}}

    result = summary([arm("static 1p2d", 0.5), arm("static 2p1d", 0.6), arm("planner", 0.9)])
    assert result["best_static"] == "static 2p1d" and result["ratio"] == 1.5
    assert summary([arm("static 1p2d", 0.5), {"arm": "planner", "error": "stack did not start"}]) == {
        "error": "an arm has no results"}


def test_planner_lines_keep_decisions_not_idle_ticks(tmp_path) -> None:
    log = tmp_path / "orchestrator.log"
    log.write_text("planner on (x)\nplanner: no action (pressures {})\nplanner: switch_role applied: p -> d\nother\n")
    assert planner_lines(log) == ["planner on (x)", "planner: switch_role applied: p -> d"]
    assert planner_lines(tmp_path / "missing.log") == []


def test_simulate_only_predicts_every_arm_without_a_stack(capsys) -> None:
    assert main(["--simulate-only", "--sim-profile", "default", "--phase-s", "20"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert "arms" not in document
    assert [arm["arm"] for arm in document["simulated"]["arms"]] == ["static 1p2d", "static 2p1d", "planner"]
    assert document["simulated"]["summary"]["errors"] == 0
    assert [phase["name"] for phase in document["phases"]] == ["decode-heavy", "prefill-heavy"]


def test_simulate_only_needs_a_profile() -> None:
    with pytest.raises(SystemExit):
        main(["--simulate-only"])
