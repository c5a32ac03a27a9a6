"""`tandem bench planner live` on sim stacks: every arm serves the same requests, the planner
arm runs the orchestrator's planner, and the simulated prediction sits beside the runs.

Timings are machine-dependent: only structure and counts are checked.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.planner.live import main

pytestmark = pytest.mark.e2e


def test_live_run_reports_every_arm_beside_its_prediction(tiny_model_dir: str, tmp_path: Path, capsys) -> None:
    out = tmp_path / "live.json"
    assert main(["--engine", "sim", "--model-dir", tiny_model_dir, "--workers", "2", "--start", "1:1",
                 "--phase-s", "3", "--decode-phase", "2:40:16", "--prefill-phase", "2:300:4",
                 "--sim-profile", "default", "--state-dir", str(tmp_path), "--out", str(out)]) == 0

    document = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == document
    arms = {arm["arm"]: arm for arm in document["arms"]}
    assert set(arms) == {"static 1p1d", "planner"}
    requests = arms["planner"]["overall"]["requests"]
    assert requests > 0
    for arm in arms.values():
        assert arm["overall"]["requests"] == arm["overall"]["completed"] == requests, arm
        assert set(arm["phases"]) == {"decode-heavy", "prefill-heavy"}
        assert sum(phase["requests"] for phase in arm["phases"].values()) == requests
    assert any("planner on" in line for line in arms["planner"]["planner_log"]), arms["planner"]["planner_log"]
    ticks = arms["planner"]["planner_ticks"]  # its decisions as the bus carried them
    assert ticks and all(set(tick) == {"at_s", "actions", "notes", "pressures"} for tick in ticks)
    assert "planner_log" not in arms["static 1p1d"] and "planner_ticks" not in arms["static 1p1d"]
    assert document["summary"]["errors"] == 0 and document["summary"]["best_static"] == "static 1p1d"
    simulated = document["simulated"]
    assert [arm["arm"] for arm in simulated["arms"]] == ["static 1p1d", "planner"]
    assert simulated["summary"]["best_static"] == "static 1p1d"
