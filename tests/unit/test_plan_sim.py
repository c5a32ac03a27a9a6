"""The planner's cluster simulator and split sweep on plain data: step times come from the
sim's timing profile, queueing and batching behave, the recommendation rule holds."""

from __future__ import annotations

import pytest

from bench.plan.cluster_sim import ClusterShape, SimSetup, StackOverheads, figures, simulate
from bench.plan.main import main as plan_main
from bench.plan.sweep import plan, shapes
from bench.plan.workload import PlanWorkload, arrivals, load_workload
from services.orchestrator.planning import Budget, Slos
from services.worker.sim.profile import TimingProfile, load_profile
from shared.config import WorkerConfig

PROFILE = load_profile("")
BATCH = WorkerConfig(worker_id="x").max_num_batched_tokens


def one_request(prompt: int, output: int, **overheads: float) -> dict:
    workload = PlanWorkload(num_requests=1, arrival_rate=1.0, prompt_tokens=prompt, output_tokens=output)
    setup = SimSetup(profile=PROFILE, overheads=StackOverheads(**overheads))
    return figures(simulate(workload, ClusterShape(1, 1), setup))


def test_lone_request_takes_the_profiles_step_times():
    prompt = 2 * BATCH + 100  # three prefill chunks
    step = PROFILE.step_duration_s
    expected_ttft = 2 * step(prefill_tokens=BATCH, decode_seqs=0) + step(prefill_tokens=100, decode_seqs=0)
    result = one_request(prompt, 10)
    assert result["ttft_ms"]["p50"] == pytest.approx(expected_ttft * 1000, rel=1e-6)
    # later gaps: one decode sequence per step on the decode worker
    assert result["itl_ms"]["p50"] == pytest.approx(step(prefill_tokens=0, decode_seqs=1) * 1000, rel=1e-6)


def test_overheads_add_real_time():
    base, slowed = one_request(600, 8), one_request(600, 8, router_ms=20.0, delivery_ms=5.0, handoff_ms=50.0)
    assert slowed["ttft_ms"]["p50"] == pytest.approx(base["ttft_ms"]["p50"] + 25.0)
    assert slowed["itl_ms"]["p90"] > base["itl_ms"]["p90"]  # the first gap carries the hand-off


def test_speedup_divides_engine_time():
    workload = PlanWorkload(num_requests=1, prompt_tokens=300, output_tokens=4)
    fast = figures(simulate(workload, ClusterShape(1, 1), SimSetup(profile=PROFILE, speedup=4.0)))
    slow = figures(simulate(workload, ClusterShape(1, 1), SimSetup(profile=PROFILE)))
    assert fast["ttft_ms"]["p50"] == pytest.approx(slow["ttft_ms"]["p50"] / 4)


def test_more_prefill_workers_cut_queueing_under_a_prefill_burst():
    workload = PlanWorkload(num_requests=150, arrival_rate=12.0, prompt_tokens=1800, output_tokens=16)
    setup = SimSetup(profile=PROFILE)
    one, two = (figures(simulate(workload, ClusterShape(p, 1), setup))["ttft_ms"]["p90"] for p in (1, 2))
    assert two < one / 2


def test_shared_prefix_is_computed_once_per_worker():
    shared = PlanWorkload(num_requests=50, arrival_rate=2.0, prompt_tokens=1024, output_tokens=2,
                          prefix_fraction=1.0, shared_prefix_tokens=960)
    distinct = PlanWorkload(num_requests=50, arrival_rate=2.0, prompt_tokens=1024, output_tokens=2)
    setup = SimSetup(profile=PROFILE)
    hit = figures(simulate(shared, ClusterShape(2, 1), setup))["ttft_ms"]["p50"]
    miss = figures(simulate(distinct, ClusterShape(2, 1), setup))["ttft_ms"]["p50"]
    assert hit < miss / 3


def test_decode_batch_beyond_kv_preempts_and_slows():
    profile = TimingProfile(prefill_ms_per_token=0.01, step_overhead_ms=1.0, decode_base_ms=5.0,
                            decode_ms_per_seq=0.5)
    workload = PlanWorkload(num_requests=120, arrival_rate=30.0, prompt_tokens=128, output_tokens=512)
    one, two = (figures(simulate(workload, ClusterShape(1, d), SimSetup(profile=profile)))["e2e_ms"]["p90"]
                for d in (1, 2))
    assert two < one


def test_arrivals_are_the_benchmarks_and_lengths_vary_within_the_spread():
    from bench.serve.prompts import arrival_offsets

    workload = PlanWorkload(num_requests=40, arrival_rate=3.0, prompt_tokens=1000, prompt_spread=0.2, seed=7)
    requests = arrivals(workload)
    assert [request.at_s for request in requests] == arrival_offsets(40, 3.0, 7)
    assert all(800 <= request.prompt_tokens <= 1200 for request in requests)
    assert len({request.prompt_tokens for request in requests}) > 10


def test_sweep_covers_the_budget_and_recommends_the_fewest_workers_meeting_slos():
    budget = Budget(max_total=4, max_prefill=3, max_decode=3)
    assert [shape.name for shape in shapes(budget)] == ["1p1d", "1p2d", "2p1d", "1p3d", "2p2d", "3p1d"]
    workload = PlanWorkload(num_requests=120, arrival_rate=12.0, prompt_tokens=1800, output_tokens=16)
    document = plan(workload, Slos(ttft_p90_ms=400.0, itl_p90_ms=50.0), budget, SimSetup(profile=PROFILE))
    best = document["recommended"]
    assert best["meets_slos"] and best["prefill"] >= 2
    assert all(not row["meets_slos"] for row in document["splits"] if row["workers"] < best["workers"])


def test_plan_command_reads_a_toml_workload(tmp_path, capsys):
    path = tmp_path / "workload.toml"
    path.write_text("[workload]\nnum_requests = 30\narrival_rate = 2.0\nprompt_tokens = 512\noutput_tokens = 8\n")
    assert load_workload(str(path), arrival_rate=3.0).arrival_rate == 3.0
    assert plan_main(["--workload", str(path), "--ttft-slo-ms", "500", "--itl-slo-ms", "50",
                      "--max-workers", "3", "--overheads", "none"]) == 0
    table = capsys.readouterr().out
    assert "1p1d" in table and "recommended: 1p1d" in table


def test_simulator_answers_the_planners_what_if_contract():
    from bench.plan.sweep import SimWhatIf
    from services.orchestrator.planning.whatif import WhatIfModel

    workload = PlanWorkload(num_requests=60, arrival_rate=12.0, prompt_tokens=1800, output_tokens=8)
    model: WhatIfModel = SimWhatIf(workload, Slos(ttft_p90_ms=400.0, itl_p90_ms=50.0), SimSetup(profile=PROFILE))
    assert model.predict(2, 1).ttft_p90_ms < model.predict(1, 1).ttft_p90_ms


def test_verify_compares_within_tolerance_and_refuses_what_the_benchmark_cannot_send():
    from bench.plan.verify import compare, serve_workload

    predicted = {"ttft_ms": {"p50": 100.0, "p90": 200.0}, "itl_ms": {"p50": 10.0, "p90": 20.0}}
    measured = {"ttft_ms": {"p50": 110.0, "p90": 150.0}, "itl_ms": {"p50": 10.0, "p90": 21.0}, "errors": 0}
    result = compare(predicted, measured, 0.25)
    assert result["figures"]["ttft_p50"]["error"] == pytest.approx(-0.0909, abs=1e-4)
    assert not result["figures"]["ttft_p90"]["within"] and not result["all_within"]
    with pytest.raises(ValueError):
        serve_workload(PlanWorkload(prompt_spread=0.1), warmup=0)
    served = serve_workload(PlanWorkload(prefix_fraction=1.0, shared_prefix_tokens=64, arrival_rate=3.0), warmup=0)
    assert served.prompts.shared_prefix_tokens == 64 and served.request_rate == 3.0 and served.ignore_eos


def test_probe_slowdown_scales_the_stack_overheads():
    from bench.plan.main import LOCAL_STACK
    from bench.plan.probe import calibrated, probe_figures, probe_workload, slowdown

    workload = PlanWorkload(prompt_tokens=1024, output_tokens=16)
    setup = SimSetup(profile=PROFILE, overheads=LOCAL_STACK)
    as_predicted = probe_figures(simulate(probe_workload(workload), ClusterShape(1, 1), setup))
    assert slowdown(workload, as_predicted, setup) == pytest.approx({"general": 1.0, "transfer": 1.0})
    doubled = calibrated(LOCAL_STACK, {"general": 2.0, "transfer": 3.0})
    assert doubled.router_ms == 2 * LOCAL_STACK.router_ms and doubled.pull_block_ms == LOCAL_STACK.pull_block_ms
    assert doubled.textless_share == LOCAL_STACK.textless_share
    slower = probe_figures(simulate(probe_workload(workload), ClusterShape(1, 1),
                                    SimSetup(profile=PROFILE, overheads=doubled)))
    assert slowdown(workload, slower, setup)["general"] == pytest.approx(2.0, rel=0.2)
