"""The routing sweep end to end: one tiny point, twice, through kv-aware and the plain
round-robin baseline, each run on a fresh local stack of sim workers; the JSON document's
shape, and the point's verdict over both repeats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.routing.family import SweepPoint
from bench.routing.sweep import SweepSetup, run_sweep
from bench.routing.workloads import EngineShape
from services.worker.sim.profile import load_profile
from shared.tokenizer import Tokenizer

pytestmark = pytest.mark.e2e

TINY = SweepPoint("tiny", tenants=2, prefix_tokens=256, query_tokens=32, max_tokens=8, kv_pressure=0.7, load=0.3)
ARMS = ("kv-aware", "round-robin-plain")
ROW_FIGURES = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "throughput_tok_s", "errors", "cached_share",
               "local_share", "pulled_share", "pulled_tokens", "recomputed_tokens", "computed_prompt_tokens",
               "evicted_blocks", "evicted_missed_blocks", "computed_imbalance", "request_imbalance")


def test_a_tiny_sweep_runs_every_arm_without_errors(tiny_model_dir: str, tmp_path: Path) -> None:
    shape = EngineShape(workers=2, block_size=16, max_num_batched_tokens=512, max_model_len=1024,
                        profile=load_profile(""), sim_speedup=0.5)
    setup = SweepSetup(shape=shape, model_dir=tiny_model_dir,
                       vocab_size=Tokenizer.from_model_dir(tiny_model_dir).vocab_size, log_root=tmp_path,
                       worker_settings={"block_size": 16, "max_num_batched_tokens": 512, "max_model_len": 1024},
                       seed=0, duration_s=3.0, drain_s=15.0, repeats=2)
    document = json.loads(json.dumps(run_sweep(setup, [TINY], ARMS)))
    assert set(document) >= {"config", "points", "arms", "results", "verdicts", "gains", "summary", "pass"}
    assert [(row["point"], row["arm"], row["repeat"]) for row in document["results"]] == [
        ("tiny", arm, repeat) for repeat in (0, 1) for arm in ARMS]
    assert {path.name for path in tmp_path.iterdir()} == {f"tiny-{arm}-{repeat}" for arm in ARMS for repeat in (0, 1)}
    for row in document["results"]:
        assert "error" not in row, row
        assert all(row[name] is not None for name in ROW_FIGURES), row
        assert row["errors"] == 0 and row["requests"] > 0
        assert 0 < row["cached_share"] <= 1 and row["local_share"] + row["pulled_share"] == pytest.approx(
            row["cached_share"], abs=1e-3)
    for plain in document["results"][1::2]:
        assert plain["pulled_tokens"] == 0, "the plain baseline must not pull prefixes"
    checks = document["verdicts"]["tiny"]
    assert checks["repeats"] == 2 and document["config"]["repeats"] == 2
    assert len(checks["p99_vs_plain"]["per_repeat"]) == 2 and checks["p99_vs_plain"]["pass"] is not None
    assert checks["p90_vs_oracle"]["pass"] is None  # no oracle arm
    assert document["gains"]["tiny"]["kv-aware"] is not None
    assert document["points"]["tiny"]["sizing"]["kv_blocks"] > 0
