"""`tandem bench planner` on short phases: every arm serves every request, the planner acts
with a reason, and the report has its figures."""

from __future__ import annotations

import json

from bench.planner.main import main


def test_short_run_reports_every_arm(tmp_path, capsys) -> None:
    out = tmp_path / "planner.json"
    assert main(["--phase-s", "12", "--splits", "1:3,3:1", "--sustain-s", "2", "--cooldown-s", "2",
                 "--out", str(out)]) == 0
    document = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == document
    arms = {arm["arm"]: arm for arm in document["arms"]}
    assert set(arms) == {"static 1p3d", "static 3p1d", "planner"}
    for arm in arms.values():
        assert arm["overall"]["completed"] == arm["overall"]["requests"] > 0
        assert set(arm["phases"]) == {"prefill-heavy", "decode-heavy", "mixed"}
        assert arm["worker_seconds"] > 0
    planner = arms["planner"]
    assert planner["actions"] and all(action["reason"] for action in planner["actions"])
    assert arms["static 1p3d"]["actions"] == []
    assert set(document["phase_check"]) == {"prefill-heavy", "decode-heavy", "mixed"}
    assert set(document["phase_check"]["mixed"]) == {"1p3d", "3p1d"}
    summary = document["summary"]
    assert summary["errors"] == 0 and summary["best_static"] in ("static 1p3d", "static 3p1d")
    assert summary["planner_attainment"] == planner["overall"]["attainment"]
