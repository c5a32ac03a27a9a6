"""`tandem bench serve` against real sim stacks: the client's counts and the side-by-side run.

Timings are machine-dependent: only structure, counts and percentile order are checked.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.serve.main import CompareSetup, compare
from bench.serve.prompts import PromptSpec
from bench.serve.run import ServeWorkload, run_serve, tokenizer_counter
from bench.serve.topology import parse_topologies
from launch.stack import LocalStack

pytestmark = pytest.mark.e2e

LATENCIES = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")


def check_percentiles(results: dict) -> None:
    for name in LATENCIES:
        figures = results[name]
        assert figures["p50"] <= figures["p90"] <= figures["p99"], (name, figures)


async def test_mode_a_against_a_sim_stack(stack: LocalStack, tiny_model_dir: str) -> None:
    workload = ServeWorkload(prompts=PromptSpec(count=8, prompt_tokens=300, seed=5), max_tokens=16, concurrency=4)

    model, results = await run_serve(stack.router_url, workload, count_tokens=tokenizer_counter(tiny_model_dir))

    assert model
    assert (results["requests"], results["completed"], results["errors"]) == (8, 8, 0), results["error_kinds"]
    assert results["output_tokens"] == 8 * 16
    assert 8 * 280 <= results["prompt_tokens"] <= 8 * 301  # the server's count; the prompts were sized for 300
    assert results["ttft_ms"]["count"] == results["e2e_ms"]["count"] == results["tpot_ms"]["count"] == 8
    # one gap per text chunk after the first; a chunk may carry several tokens (held-back bytes)
    assert results["itl_ms"]["count"] == results["text_chunks"] - 8
    assert 8 * 8 <= results["text_chunks"] <= 8 * 16
    check_percentiles(results)
    assert results["duration_s"] > 0 and results["output_throughput_tok_s"] > 0


async def test_mode_a_reports_failures_as_errors(stack: LocalStack) -> None:
    workload = ServeWorkload(prompts=PromptSpec(count=3, prompt_tokens=20), max_tokens=4, warmup=0)

    _, results = await run_serve(stack.router_url, workload, model="no-such-model")

    assert (results["requests"], results["errors"]) == (3, 3)
    assert list(results["error_kinds"]) == ["http 404 model_not_found"]


def test_mode_b_compares_disaggregated_and_single_workers(tiny_model_dir: str, tmp_path: Path) -> None:
    workload = ServeWorkload(prompts=PromptSpec(count=4, prompt_tokens=300), max_tokens=8, concurrency=2, warmup=1)
    setup = CompareSetup(engine="sim", model_dir=tiny_model_dir, log_root=tmp_path)

    document = compare(parse_topologies("1p1d,2x1"), workload, setup)

    assert list(document["topologies"]) == ["1p1d", "2x1"]
    for results in document["topologies"].values():
        assert (results["requests"], results["errors"], results["output_tokens"]) == (4, 0, 4 * 8)
        check_percentiles(results)
    assert document["topologies"]["1p1d"]["disaggregated_requests"] == 5  # warm-up included
    assert document["topologies"]["2x1"]["disaggregated_requests"] == 0
    assert document["topologies"]["1p1d"]["kv_transfer_modes"] == {"pull": 5}  # the router's default
    assert document["topologies"]["2x1"]["kv_transfer_modes"] == {}
    assert document["ratios"]["ttft_p50"] is not None and document["ratios"]["output_throughput"] is not None
