"""`python -m bench.router.rate_cost`: a tiny run as a user runs it (Tandem only, two rates,
two rounds), in a subprocess; its ratio arithmetic; its refusals."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.router.rate_cost import rate_ratios


def test_a_tiny_run_reports_every_rate_of_every_round(tiny_model_dir: str, tmp_path) -> None:
    out = tmp_path / "rates.json"
    completed = subprocess.run(
        [sys.executable, "-m", "bench.router.rate_cost", "--systems", "tandem", "--rates", "40,20", "--rounds", "2",
         "--seconds", "1.5", "--idle-seconds", "1", "--model-dir", tiny_model_dir, "--state-dir", str(tmp_path / "state"),
         "--out", str(out)],
        capture_output=True, text=True, timeout=240)
    assert completed.returncode == 0, completed.stderr[-3000:]
    document = json.loads(completed.stdout)
    assert json.loads(out.read_text()) == document
    assert document["config"]["rates_rps"] == [20.0, 40.0]
    assert set(document["idle_cpu_ms_per_s"]) == {"tandem"} and document["idle_cpu_ms_per_s"]["tandem"] >= 0
    runs = document["runs"]
    # round 1 offers the rates low to high, round 2 high to low
    assert [(run["round"], run["rate_rps"]) for run in runs] == [(0, 20.0), (0, 40.0), (1, 40.0), (1, 20.0)]
    assert all(run["errors"] == 0 and run["requests"] == int(run["rate_rps"] * 1.5) for run in runs)
    assert all(run["router_cpu_us_per_request"] > 0 for run in runs)
    tandem = document["systems"]["tandem"]
    assert tandem["40"]["ratio_to_40_per_s"]["per_round"] == [1.0, 1.0]
    assert len(tandem["20"]["ratio_to_40_per_s"]["per_round"]) == 2
    assert tandem["20"]["router_cpu_us_per_request"]["rounds"] == 2


def test_each_rate_is_held_against_the_same_rounds_highest() -> None:
    runs = [{"round": 0, "system": "a", "rate_rps": 100.0, "router_cpu_us_per_request": 3000.0},
            {"round": 0, "system": "a", "rate_rps": 200.0, "router_cpu_us_per_request": 2000.0},
            {"round": 1, "system": "a", "rate_rps": 200.0, "router_cpu_us_per_request": 1000.0},
            {"round": 1, "system": "a", "rate_rps": 100.0, "router_cpu_us_per_request": 1200.0},
            {"round": 0, "system": "b", "rate_rps": 100.0, "router_cpu_us_per_request": 900.0}]
    result = rate_ratios(runs)
    assert result["a"]["100"]["ratio_to_200_per_s"]["per_round"] == [1.5, 1.2]
    assert result["a"]["100"]["ratio_to_200_per_s"]["median"] == pytest.approx(1.35)
    assert result["a"]["100"]["router_cpu_us_per_request"]["median"] == 2100.0
    assert result["a"]["200"]["ratio_to_200_per_s"]["per_round"] == [1.0, 1.0]
    assert result["b"]["100"]["ratio_to_100_per_s"]["per_round"] == [1.0]


@pytest.mark.parametrize(("flag", "value", "says"), [("--rates", "0,100", "--rates takes positive"),
                                                     ("--rates", "fast", "--rates takes positive"),
                                                     ("--rounds", "0", "must be positive"),
                                                     ("--idle-seconds", "0", "must be positive"),
                                                     ("--systems", "vllm", "--systems takes tandem")])
def test_bad_arguments_are_refused_before_anything_starts(flag: str, value: str, says: str) -> None:
    completed = subprocess.run([sys.executable, "-m", "bench.router.rate_cost", flag, value],
                               capture_output=True, text=True, timeout=60)
    assert completed.returncode == 2 and says in completed.stderr
