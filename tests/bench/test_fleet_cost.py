"""`python -m bench.router.fleet_cost`: a tiny run (a fleet of 8 simulated workers before 1
and 2 routers) as a user runs it, in a subprocess; and its projection's arithmetic."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.router.fleet_cost import projection, summed_cpu_per_request_us

ROUTER_BENCH = {"systems": {
    "tandem": {"concurrent": {"router_cpu_us_per_request": {"median": 1000.0}}},
    "tandem-2-routers": {"concurrent": {"router_cpu_us_per_request": {"median": 1200.0}}},
    "dynamo": {"concurrent": {"router_cpu_us_per_request": {"median": 900.0}}},
}}


def test_a_tiny_run_measures_every_process_and_projects(tiny_model_dir: str, tmp_path) -> None:
    bench_file = tmp_path / "router.json"
    bench_file.write_text(json.dumps(ROUTER_BENCH))
    out = tmp_path / "cost.json"
    completed = subprocess.run(
        [sys.executable, "-m", "bench.router.fleet_cost", "--fleets", "8", "--routers", "1,2", "--window", "1",
         "--windows", "2", "--model-dir", tiny_model_dir, "--router-bench", str(bench_file), "--out", str(out)],
        capture_output=True, text=True, timeout=180)
    assert completed.returncode == 0, completed.stderr[-3000:]
    document = json.loads(completed.stdout)
    assert json.loads(out.read_text()) == document
    assert [(run["fleet"], run["routers"]) for run in document["runs"]] == [(8, 1), (8, 2)]
    for run in document["runs"]:
        assert len(run["windows"]) == 2
        routers = ["router"] + [f"router-{n}" for n in range(2, run["routers"] + 1)]
        for window in run["windows"]:
            assert set(window["cores"]) == {*routers, "metrics", "orchestrator", "fleet"}
            assert all(cores >= 0 for cores in window["cores"].values())
            assert window["messages_per_s"]["heartbeats"] > 0 and window["messages_per_s"]["load_snapshots"] > 0
        # CPU time counts in clock ticks (10 ms): one idle process before 8 workers may show none
        # in a window, not all of them in all windows
        assert 0 <= run["router_cores_per_router_median"] < 1
        assert sum(cores for window in run["windows"] for cores in window["cores"].values()) > 0
    rows = document["projection"]["rows"]
    assert [(row["routers"], row["summed_cpu_us_per_request"]) for row in rows] == [(1, 1000.0), (2, 1200.0)]


def test_the_projection_is_the_cores_left_over_the_summed_cost() -> None:
    assert summed_cpu_per_request_us(ROUTER_BENCH) == {1: 1000.0, 2: 1200.0}
    assert projection(0.0, 1, 1000.0) == pytest.approx(1000.0)
    assert projection(0.1, 2, 1200.0) == pytest.approx(2 * 0.9 / 0.0012)
    assert projection(1.5, 4, 1000.0) == 0.0  # background past a core: nothing left


def test_bad_counts_are_refused_before_anything_starts() -> None:
    completed = subprocess.run([sys.executable, "-m", "bench.router.fleet_cost", "--fleets", "0"],
                               capture_output=True, text=True, timeout=60)
    assert completed.returncode != 0 and "--fleets takes positive whole numbers" in completed.stderr
