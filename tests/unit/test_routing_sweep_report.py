"""The routing sweep's pure parts around a run: verdicts, gains, the counters' split, arms."""

from __future__ import annotations

import pytest

from bench.routing.arms import PIN_HEADER, NoPinning, Pinning, arms, kv_aware_settings, rotated
from bench.routing.counters import counters_from_cluster, imbalance, sweep_figures
from bench.routing.family import SweepPoint
from bench.routing.oracle import GroupSpec, Oracle
from bench.routing.report import gains, median_gains, over_repeats, summary, table, verdict
from bench.routing.workloads import EngineShape
from services.worker.sim.profile import load_profile

SHAPE = EngineShape(workers=2, block_size=16, max_num_batched_tokens=512, max_model_len=2048,
                    profile=load_profile(""), sim_speedup=0.25)


def row(p90: float, p99: float, share: float, **extra) -> dict:
    return {"ttft_p50_ms": p90 / 2, "ttft_p90_ms": p90, "ttft_p99_ms": p99, "cached_share": share, **extra}


def test_a_point_passes_when_kv_aware_is_close_to_the_oracle_and_beats_plain() -> None:
    rows = {"kv-aware": row(120, 200, 0.86), "round-robin-plain": row(900, 1500, 0.3), "oracle": row(100, 180, 0.9)}
    checks = verdict(SweepPoint("p", kv_pressure=0.7), rows)
    assert checks["p99_vs_plain"]["pass"] and checks["p90_vs_oracle"] == {"ratio": 1.2, "limit": 1.3, "pass": True}
    assert checks["cached_share_vs_oracle"]["relative_gap"] == 0.044 and checks["pass"] is True


def test_the_learned_oracle_is_a_reference_ratio_outside_the_points_outcome() -> None:
    rows = {"kv-aware": row(150, 200, 0.86), "round-robin-plain": row(900, 1500, 0.3), "oracle": row(100, 180, 0.9)}
    without = verdict(SweepPoint("p", kv_pressure=1.2), rows)
    assert "p90_vs_learned_oracle" not in without and without["pass"] is False
    checks = verdict(SweepPoint("p", kv_pressure=1.2), {**rows, "oracle-learned": row(160, 300, 0.8)})
    assert checks["p90_vs_learned_oracle"] == {"ratio": 0.938}
    assert checks["p90_vs_oracle"]["pass"] is False and checks["pass"] is False  # the oracle still judges


def test_each_check_fails_on_its_own() -> None:
    point = SweepPoint("p", kv_pressure=0.7)
    worse_tail = verdict(point, {"kv-aware": row(120, 1600, 0.9), "round-robin-plain": row(900, 1500, 0.3),
                                 "oracle": row(100, 180, 0.9)})
    assert worse_tail["p99_vs_plain"]["pass"] is False and worse_tail["pass"] is False
    slow = verdict(point, {"kv-aware": row(140, 200, 0.9), "round-robin-plain": row(900, 1500, 0.3),
                           "oracle": row(100, 180, 0.9)})
    assert slow["p90_vs_oracle"]["pass"] is False and slow["p99_vs_plain"]["pass"] is True
    spread = verdict(point, {"kv-aware": row(120, 200, 0.6), "round-robin-plain": row(900, 1500, 0.3),
                             "oracle": row(100, 180, 0.9)})
    assert spread["cached_share_vs_oracle"]["pass"] is False and spread["pass"] is False


def test_over_full_points_skip_the_share_check_and_missing_arms_give_no_verdict() -> None:
    rows = {"kv-aware": row(120, 200, 0.2), "round-robin-plain": row(900, 1500, 0.1), "oracle": row(100, 180, 0.6)}
    assert "cached_share_vs_oracle" not in verdict(SweepPoint("p", kv_pressure=1.2), rows)
    assert verdict(SweepPoint("p", kv_pressure=1.2), rows)["pass"] is True
    partial = verdict(SweepPoint("p"), {"kv-aware": row(120, 200, 0.9),
                                        "round-robin-plain": {"error": "the stack did not start"}})
    assert partial["p99_vs_plain"]["pass"] is None and partial["p90_vs_oracle"]["pass"] is None
    assert partial["pass"] is None


def test_the_gain_over_plain_is_held_against_dynamos_gain_over_its_round_robin() -> None:
    point = SweepPoint("p", kv_pressure=0.7)
    base = {"kv-aware": row(100, 200, 0.9), "round-robin-plain": row(1000, 1500, 0.3), "oracle": row(100, 180, 0.9)}
    ahead = verdict(point, {**base, "dynamo-kv": row(50, 90, 0.9), "dynamo-round-robin": row(400, 600, 0.3)})
    assert ahead["gain_vs_dynamo"] == {"tandem_gain": 10.0, "dynamo_gain": 8.0, "pass": True} and ahead["pass"]
    behind = verdict(point, {**base, "dynamo-kv": row(50, 90, 0.9), "dynamo-round-robin": row(600, 900, 0.3)})
    assert behind["gain_vs_dynamo"]["pass"] is False and behind["pass"] is False
    assert "gain_vs_dynamo" not in verdict(point, base)
    missing = verdict(point, {**base, "dynamo-kv": row(50, 90, 0.9)})
    assert missing["gain_vs_dynamo"]["pass"] is None and missing["pass"] is None


def test_repeated_runs_are_judged_on_the_median_ratio_with_the_spread_kept() -> None:
    point = SweepPoint("p", kv_pressure=0.7)
    plain, oracle = row(900, 1500, 0.3), row(100, 180, 0.9)
    runs = [verdict(point, {"kv-aware": row(p90, p99, 0.88), "round-robin-plain": plain, "oracle": oracle})
            for p90, p99 in ((110, 200), (200, 1600), (125, 300))]
    checks = over_repeats(runs)
    assert checks["repeats"] == 3
    assert checks["p90_vs_oracle"] == {"per_repeat": [1.1, 2.0, 1.25], "passed_repeats": 2, "median": 1.25,
                                       "min": 1.1, "max": 2.0, "pass": True, "limit": 1.3}
    assert checks["p99_vs_plain"]["per_repeat"] == [0.133, 1.067, 0.2] and checks["p99_vs_plain"]["pass"] is True
    assert checks["p99_vs_plain"]["passed_repeats"] == 2 and checks["pass"] is True
    slow = over_repeats(runs[1:] + [runs[1]])  # 2.0, 1.25, 2.0: the median fails
    assert slow["p90_vs_oracle"]["median"] == 2.0 and slow["p90_vs_oracle"]["pass"] is False
    assert slow["pass"] is False


def test_a_repeat_without_a_figure_leaves_the_check_undecided() -> None:
    point = SweepPoint("p", kv_pressure=1.2)
    whole = verdict(point, {"kv-aware": row(110, 200, 0.6), "round-robin-plain": row(900, 1500, 0.3),
                            "oracle": row(100, 180, 0.7), "oracle-learned": row(100, 200, 0.6)})
    broken = verdict(point, {"kv-aware": row(110, 200, 0.6), "round-robin-plain": row(900, 1500, 0.3),
                             "oracle": {"error": "the stack did not start"}, "oracle-learned": row(200, 300, 0.6)})
    checks = over_repeats([whole, broken])
    assert checks["p90_vs_oracle"]["pass"] is None and checks["p90_vs_oracle"]["per_repeat"] == [1.1, None]
    assert checks["p99_vs_plain"]["pass"] is True and checks["pass"] is None
    assert "cached_share_vs_oracle" not in checks  # over-full: no share check in any run
    assert checks["p90_vs_learned_oracle"] == {"per_repeat": [1.1, 0.55], "median": 0.825, "min": 0.55, "max": 1.1}


def test_dynamo_gains_over_repeats_compare_per_run_and_median_gains_take_each_arms_median() -> None:
    point = SweepPoint("p", kv_pressure=0.7)
    base = {"round-robin-plain": row(900, 1500, 0.3), "oracle": row(100, 180, 0.9),
            "dynamo-round-robin": row(800, 1400, 0.3)}
    runs = [verdict(point, {**base, "kv-aware": row(100, 200, 0.88), "dynamo-kv": row(dynamo_p90, 300, 0.8)})
            for dynamo_p90 in (200, 50, 100)]  # Tandem's gain 9 against Dynamo's 4, 16, 8
    checks = over_repeats(runs)
    assert checks["gain_vs_dynamo"]["per_repeat"] == [2.25, 0.562, 1.125]
    assert checks["gain_vs_dynamo"]["median"] == 1.125 and checks["gain_vs_dynamo"]["pass"] is True
    assert median_gains([{"kv-aware": 9.0, "oracle": 8.0}, {"kv-aware": 3.0, "oracle": None},
                         {"kv-aware": 5.0, "oracle": 7.0}]) == {"kv-aware": 5.0, "oracle": None}
    assert over_repeats([])["pass"] is None and median_gains([]) == {}


def test_gains_are_over_each_arms_own_baseline() -> None:
    rows = {"kv-aware": row(100, 1, 0), "round-robin-plain": row(400, 1, 0), "dynamo-kv": row(50, 1, 0),
            "dynamo-round-robin": row(100, 1, 0)}
    baselines = {name: arm.baseline for name, arm in arms(SHAPE).items() if name in rows}
    assert gains(rows, baselines) == {"kv-aware": 4.0, "dynamo-kv": 2.0}


def test_summary_and_table_show_every_row() -> None:
    rows = [{"point": "p", "arm": "kv-aware", **row(100, 150, 0.9), "local_share": 0.8, "pulled_share": 0.1,
             "evicted_blocks": 3, "evicted_missed_blocks": 1, "computed_imbalance": 1.1, "errors": 0},
            {"point": "p", "arm": "oracle", "error": "no launcher"}]
    lines = summary(rows)
    assert lines[0]["ttft_p90_ms"] == 100 and lines[0]["local_share"] == 0.8 and lines[1] == {
        "point": "p", "arm": "oracle", "error": "no launcher"}
    text = table(rows)
    assert "kv-aware" in text and "error: no launcher" in text and len(text.splitlines()) == 3


def cluster(**workers: dict) -> dict:
    base = {"prompt_tokens_total": 0, "cached_tokens_total": 0, "kv_pulled_tokens_total": 0, "running": 0,
            "waiting": 0}
    return {"workers": [{"worker_id": name, **base, **values} for name, values in workers.items()]}


def test_sweep_figures_split_local_hits_from_pulled_tokens() -> None:
    before = counters_from_cluster(cluster(a={"prompt_tokens_total": 100}, b={}))
    after = counters_from_cluster(cluster(
        a={"prompt_tokens_total": 1100, "cached_tokens_total": 800, "kv_pulled_tokens_total": 200,
           "computed_prompt_tokens_total": 300, "generated_tokens_total": 160, "kv_evicted_blocks_total": 4,
           "kv_evicted_missed_blocks_total": 1},
        b={"prompt_tokens_total": 1000, "cached_tokens_total": 500, "computed_prompt_tokens_total": 100,
           "generated_tokens_total": 160, "kv_recomputed_tokens_total": 32}))
    figures = sweep_figures(before, after)
    assert figures["prompt_tokens"] == 2000 and figures["cached_share"] == 0.65
    assert figures["local_share"] == 0.55 and figures["pulled_share"] == 0.1 and figures["pulled_tokens"] == 200
    assert (figures["evicted_blocks"], figures["evicted_missed_blocks"], figures["recomputed_tokens"]) == (4, 1, 32)
    assert figures["computed_imbalance"] == 1.5 and figures["request_imbalance"] == 1.0
    assert imbalance({}) is None and imbalance({"a": 0, "b": 0}) is None


def test_arms_map_to_router_settings_and_the_oracle_pins_by_header() -> None:
    by_name = arms(SHAPE)
    assert by_name["round-robin-plain"].settings == {"routing_policy": "round-robin", "prefix_pull": False}
    assert by_name["round-robin-pull"].settings == {"routing_policy": "round-robin"}
    # a host-tier hit weighs the profile's own load / prefill time (the packaged default: a fifth)
    assert by_name["kv-aware"].settings == kv_aware_settings(SHAPE) == {"routing_policy": "kv-aware",
                                                                       "host_load_weight": 0.2}
    assert by_name["kv-tier-blind"].settings == {**kv_aware_settings(SHAPE), "kv_tier_aware": False}
    assert by_name["oracle"].settings == {"routing_policy": "pinned"} and by_name["oracle"].oracle
    learned = by_name["oracle-learned"]
    assert learned.settings == {"routing_policy": "pinned"} and learned.oracle and learned.learn_per_group > 0
    assert by_name["oracle"].learn_per_group == 0
    assert NoPinning().begin("tenant-0") == ({}, None)
    pinning = Pinning(Oracle(["w1", "w2"], 1000, {"t": GroupSpec(100, 0.5)}))
    headers, worker = pinning.begin("t")
    assert headers == {PIN_HEADER: worker} and pinning.outstanding[worker] == 1
    other_headers, other = pinning.begin(None)  # unique: the least outstanding, so the other worker
    assert other != worker
    pinning.end(worker)
    pinning.end(other)
    assert sum(pinning.outstanding.values()) == 0


def test_arm_order_rotates_from_point_to_point() -> None:
    names = ["a", "b", "c", "d"]
    assert [rotated(names, index)[0] for index in range(5)] == ["a", "b", "c", "d", "a"]
    assert sorted(rotated(names, 3)) == names and rotated([], 2) == []


def test_tier_aware_routing_passes_against_blind_with_more_cached_and_a_lower_p90() -> None:
    point = SweepPoint("tiered", tenants=12, kv_pressure=2.0, host_tier=2.0)
    aware = {"ttft_p90_ms": 300.0, "ttft_p99_ms": 400.0, "cached_share": 0.9}
    blind = {"ttft_p90_ms": 400.0, "ttft_p99_ms": 500.0, "cached_share": 0.8}
    check = verdict(point, {"kv-aware": aware, "kv-tier-blind": blind})["tiers_vs_blind"]
    assert check["pass"] is True and check["p90_ratio"] == 0.75
    assert verdict(point, {"kv-aware": blind, "kv-tier-blind": aware})["tiers_vs_blind"]["pass"] is False
    more_cached_but_slower = {**aware, "ttft_p90_ms": 450.0}
    assert verdict(point, {"kv-aware": more_cached_but_slower, "kv-tier-blind": blind})["tiers_vs_blind"]["pass"] is False
    assert verdict(point, {"kv-aware": aware, "kv-tier-blind": {"error": "x"}})["tiers_vs_blind"]["pass"] is None
    repeated = over_repeats([verdict(point, {"kv-aware": aware, "kv-tier-blind": blind})] * 2)
    assert repeated["tiers_vs_blind"]["median"] == 0.75 and repeated["tiers_vs_blind"]["pass"] is True


def test_a_tiered_point_sizes_each_workers_host_tier_from_its_pool() -> None:
    from bench.routing.family import TIER_SWEEP, points_named, size_point

    sizing = size_point(TIER_SWEEP[0], SHAPE)
    assert sizing.kv_host_blocks == round(sizing.kv_blocks * TIER_SWEEP[0].host_tier) > 0
    assert size_point(SweepPoint("plain"), SHAPE).kv_host_blocks == 0
    assert points_named(["tiered"]) == [TIER_SWEEP[0]]


def test_a_sweep_at_another_load_offers_that_share_of_each_points_cache_blind_capacity() -> None:
    from bench.routing.family import TIER_SWEEP, at_load, size_point
    from bench.routing.sweep import main

    busy = at_load(TIER_SWEEP, 3.0)
    assert [point.name for point in busy] == [point.name for point in TIER_SWEEP] and busy[0].load == 3.0
    assert busy[0].host_tier == TIER_SWEEP[0].host_tier
    own = size_point(TIER_SWEEP[0], SHAPE)
    assert abs(size_point(busy[0], SHAPE).rate_rps - own.rate_rps * 3.0 / TIER_SWEEP[0].load) < 1e-9
    with pytest.raises(SystemExit, match="--load must be positive"):
        main(["--points", "tiered", "--load", "-1"])
