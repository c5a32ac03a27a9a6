"""`tandem bench soak`: a short run (about 20 s of load) on a real local stack, as a user
runs it (the `tandem` command in a subprocess); the JSON document has its shape, no
request failed and nothing was left over. Whether memory grows is judged only on long
runs: a short one must say it did not judge it."""

from __future__ import annotations

import json
import subprocess
import sys

KINDS = {"chat-stream", "chat-whole", "completions-stream", "completions-whole"}
PROCESSES = {"nats", "orchestrator", "metrics", "router", "p1", "d1", "d2"}


def test_a_short_soak_reports_every_figure_and_no_error(tiny_model_dir: str, tmp_path) -> None:
    out = tmp_path / "soak.json"
    completed = subprocess.run(
        [sys.executable, "-m", "cli.main", "bench", "soak", "--minutes", "0.3", "--concurrency", "8", "--seed", "3",
         "--json", "--out", str(out), "--model-dir", tiny_model_dir, "--state-dir", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-3000:]
    document = json.loads(completed.stdout)
    assert json.loads(out.read_text()) == document
    assert "bench_soak: " in completed.stderr  # progress on stderr, the document alone on stdout

    assert set(document) == {"config", "duration_s", "model", "requests", "memory", "leftovers", "verdict"}
    assert document["config"]["minutes"] == 0.3 and document["config"]["seed"] == 3
    assert 17 <= document["duration_s"] <= 30

    requests = document["requests"]
    assert requests["errors"] == 0 and requests["error_reasons"] == {}, requests
    assert requests["by_outcome"].get("ok", 0) > 20
    assert set(requests["by_kind"]) == KINDS  # the mix reached every kind
    assert sum(sum(counts.values()) for counts in requests["by_kind"].values()) == requests["total"]
    for figure in ("latency_ms", "ttft_ms"):
        assert requests[figure]["count"] > 0 and 0 < requests[figure]["p50"] <= requests[figure]["p99"]

    memory = document["memory"]
    assert set(memory) == PROCESSES
    for figures in memory.values():
        assert figures["samples"] >= 10
        assert 0 < figures["start_mb"] and figures["end_mb"] <= figures["max_mb"]
        assert isinstance(figures["slope_mb_per_min_second_half"], float)
        assert figures["slope_judged"] is False  # 10 s of second half: too short to judge
        series = figures["series_s_mb"]
        assert 2 <= len(series) <= 41 and series[0][1] == figures["start_mb"] and series[-1][1] == figures["end_mb"]
        assert [at for at, _ in series] == sorted(at for at, _ in series)

    leftovers = document["leftovers"]
    assert leftovers["total"] == 0 and leftovers["router_in_flight"] == 0, leftovers
    assert set(leftovers["leases_held"]) == {"p1", "d1", "d2"}
    assert leftovers["settled_after_s"] is not None

    assert document["verdict"] == {"pass": True, "reasons": [], "memory_judged": False,
                                   "rss_slope_bound_mb_per_min": 2.0}
