"""`tandem bench router`: a tiny run (Tandem only, a few requests) as a user runs it (the
`tandem` command in a subprocess); the JSON document has its shape and no request failed.
Two routers are compared with one; a router count out of range is refused before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

FIGURES = {"requests", "errors", "duration_s", "requests_per_s", "p50_ms", "p99_ms", "router_cpu_us_per_request"}


def _bench(args: list[str], timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.main", "bench", "router", *args],
                          capture_output=True, text=True, timeout=timeout_s)


def test_a_tiny_tandem_run_reports_every_figure(tiny_model_dir: str, tmp_path) -> None:
    out = tmp_path / "router.json"
    completed = _bench(["--systems", "tandem", "--rounds", "2", "--requests", "24", "--concurrency", "4",
                        "--sequential", "5", "--warmup", "4", "--model-dir", tiny_model_dir,
                        "--state-dir", str(tmp_path / "state"), "--out", str(out)])
    assert completed.returncode == 0, completed.stderr[-3000:]
    document = json.loads(completed.stdout)
    assert json.loads(out.read_text()) == document
    assert "bench_router: " in completed.stderr  # progress on stderr, the document alone on stdout

    assert set(document) == {"config", "duration_s", "host", "systems", "ratios", "rounds"}
    assert document["host"]["cpus"] >= 1 and document["host"]["load_average_1m_end"] >= 0
    assert document["config"]["systems"] == ["tandem"] and document["config"]["routers"] == [1]
    assert document["ratios"] == {}  # no Dynamo, nothing to compare with
    assert len(document["rounds"]) == 2
    for one in document["rounds"]:
        assert set(one) == {"tandem"} and set(one["tandem"]) == {"concurrent", "sequential"}
        concurrent, sequential = one["tandem"]["concurrent"], one["tandem"]["sequential"]
        assert set(concurrent) == FIGURES and set(sequential) == FIGURES
        assert concurrent["requests"] == 24 and sequential["requests"] == 5
        assert concurrent["errors"] == 0 and sequential["errors"] == 0
        assert concurrent["requests_per_s"] > 0 and 0 < concurrent["p50_ms"] <= concurrent["p99_ms"]
        assert concurrent["router_cpu_us_per_request"] >= 0
    summary = document["systems"]["tandem"]
    for phase in ("concurrent", "sequential"):
        for figure in FIGURES - {"requests", "errors", "duration_s"}:
            spread = summary[phase][figure]
            assert spread["rounds"] == 2 and spread["min"] <= spread["median"] <= spread["max"]


def _one_round(model_dir: str, tmp_path, *args: str) -> dict:
    """The document of one round of Tandem alone with no sequential phase; `args` add to it."""
    completed = _bench(["--systems", "tandem", "--rounds", "1", "--sequential", "0", "--warmup", "4",
                        "--model-dir", model_dir, "--state-dir", str(tmp_path / "state"), *args])
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout)


def test_two_routers_are_compared_with_one(tiny_model_dir: str, tmp_path) -> None:
    document = _one_round(tiny_model_dir, tmp_path, "--routers", "1,2", "--requests", "16", "--concurrency", "4")
    assert set(document["systems"]) == {"tandem", "tandem-2-routers"}
    assert document["rounds"][0]["tandem-2-routers"]["concurrent"]["errors"] == 0
    assert set(document["ratios"]) == {"tandem-2-routers/tandem"}


def test_router_counts_the_bench_does_not_start_are_refused(tmp_path) -> None:
    completed = _bench(["--systems", "tandem", "--routers", "1,17", "--state-dir", str(tmp_path / "state")],
                       timeout_s=60)
    assert completed.returncode == 2
    assert "17 router processes" in completed.stderr and completed.stdout == ""


def test_an_open_loop_run_offers_the_rate_asked(tiny_model_dir: str, tmp_path) -> None:
    document = _one_round(tiny_model_dir, tmp_path, "--requests", "30", "--rate", "20", "--concurrency", "8",
                          "--kv-event-interval", "0.05")
    assert document["config"]["rate"] == 20 and document["config"]["kv_event_interval"] == 0.05
    concurrent = document["rounds"][0]["tandem"]["concurrent"]
    assert concurrent["requests"] == 30 and concurrent["errors"] == 0
    # 30 requests 50 ms apart: the last is sent 1.45 s after the first, so no faster than the rate
    assert concurrent["duration_s"] >= 1.45 and concurrent["requests_per_s"] <= 20.7


@pytest.mark.parametrize("option", ["--rate", "--kv-event-interval"])
def test_a_negative_rate_or_interval_is_refused(option: str, tmp_path) -> None:
    completed = _bench(["--systems", "tandem", option, "-5", "--state-dir", str(tmp_path / "state")], timeout_s=60)
    assert completed.returncode == 2 and f"{option} must not be negative" in completed.stderr
