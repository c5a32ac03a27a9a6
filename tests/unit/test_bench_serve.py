"""The serving benchmark's pure parts: prompts, arrivals, figures, topologies."""

from __future__ import annotations

import dataclasses

import pytest

from bench.serve.peer import PeerPlan, router_argv, server_argv
from bench.serve.prompts import DISTINCT_HEAD_WORDS, PromptSpec, arrival_offsets, build_prompts, word_pool
from bench.serve.run import ServeWorkload
from bench.serve.stats import RequestRecord, Slo, distribution_ms, ratios, summarize
from bench.serve.topology import ALWAYS_DISAGGREGATE, Topology, parse_topologies, parse_topology, worker_specs
from launch.argv import worker_args
from launch.plan import StackConfig
from services.worker.vllm.options import VllmEngineOptions
from shared.schemas import WorkerRole

# ---- prompts ---------------------------------------------------------------------------------


def test_prompts_are_reproducible_from_the_seed() -> None:
    spec = PromptSpec(count=5, prompt_tokens=200, seed=7)
    assert build_prompts(spec) == build_prompts(spec)
    assert build_prompts(spec) != build_prompts(PromptSpec(count=5, prompt_tokens=200, seed=8))


def test_prompts_have_the_requested_length_in_counted_tokens() -> None:
    for prompt in build_prompts(PromptSpec(count=4, prompt_tokens=300)):
        assert len(prompt.split()) == 300  # one token per word by default

    def two_per_long_word(piece: str) -> int:
        return 2 if len(piece.strip()) > 6 else 1

    for prompt in build_prompts(PromptSpec(count=4, prompt_tokens=300), two_per_long_word):
        words = prompt.split()
        assert sum(two_per_long_word(word) for word in words) == 300


def test_prompts_differ_from_their_first_words() -> None:
    # a tiny pool makes collisions likely: the guarantee must hold anyway
    words = ("alpha", "beta", "gamma")
    prompts = build_prompts(PromptSpec(count=200, prompt_tokens=20), words=words)
    heads = {tuple(prompt.split()[:DISTINCT_HEAD_WORDS]) for prompt in prompts}
    assert len(heads) == 200


def test_shared_prefix_is_common_and_the_rest_is_distinct() -> None:
    prompts = build_prompts(PromptSpec(count=10, prompt_tokens=120, shared_prefix_tokens=50, seed=3))
    assert len({tuple(prompt.split()[:50]) for prompt in prompts}) == 1
    assert len({tuple(prompt.split()[50:50 + DISTINCT_HEAD_WORDS]) for prompt in prompts}) == 10
    assert all(len(prompt.split()) == 120 for prompt in prompts)


def test_appended_prompts_leave_earlier_ones_unchanged() -> None:
    """Warm-up prompts are appended: the measured ones do not depend on how many."""
    assert build_prompts(PromptSpec(count=6, prompt_tokens=40))[:4] == build_prompts(PromptSpec(count=4,
                                                                                                prompt_tokens=40))


def test_word_pool_is_plain_words() -> None:
    pool = word_pool()
    assert len(pool) > 500 and list(pool) == sorted(set(pool)) and all(word.isalpha() for word in pool)


def test_prompt_spec_rejects_a_shared_prefix_as_long_as_the_prompt() -> None:
    with pytest.raises(ValueError):
        PromptSpec(count=1, prompt_tokens=10, shared_prefix_tokens=10)


def test_poisson_arrivals_are_seeded_and_ordered() -> None:
    offsets = arrival_offsets(1000, rate_rps=20.0, seed=1)
    assert offsets == arrival_offsets(1000, rate_rps=20.0, seed=1)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert 999 / offsets[-1] == pytest.approx(20.0, rel=0.15)


def test_the_workload_plan_is_closed_or_open_loop() -> None:
    spec = PromptSpec(count=3, prompt_tokens=10)
    assert ServeWorkload(prompts=spec, max_tokens=4, concurrency=2).plan().concurrency == 2
    plan = ServeWorkload(prompts=spec, max_tokens=4, request_rate=5.0).plan()
    assert plan.arrivals is not None and len(plan.arrivals) == 3


# ---- figures ---------------------------------------------------------------------------------


def _record(sent: float, chunks: list[float], tokens: int, prompt_tokens: int | None = 100) -> RequestRecord:
    return RequestRecord(sent_at=sent, text_chunk_at=chunks, ended_at=chunks[-1] + 0.001,
                         prompt_tokens=prompt_tokens, output_tokens=tokens)


def test_record_latencies() -> None:
    record = _record(10.0, [10.5, 10.6, 10.8], tokens=3)
    assert record.ttft_s == pytest.approx(0.5)
    assert record.itl_s == pytest.approx([0.1, 0.2])
    assert record.e2e_s == pytest.approx(0.801)
    assert record.tpot_s == pytest.approx(0.301 / 2)


def test_distribution_percentiles_are_ordered() -> None:
    figures = distribution_ms([0.001 * value for value in range(1, 101)])
    assert figures["count"] == 100
    assert figures["p50"] == pytest.approx(50.5) and figures["mean"] == pytest.approx(50.5)
    assert figures["p50"] <= figures["p90"] <= figures["p99"]
    assert distribution_ms([]) == {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None}


def test_summary_counts_errors_and_throughput_of_successes_only() -> None:
    records = [_record(0.0, [0.1, 0.2, 0.3], tokens=3), _record(0.0, [0.2, 0.4], tokens=4, prompt_tokens=None),
               RequestRecord(sent_at=0.0, error="http 500"), RequestRecord(sent_at=0.0, error="timeout"),
               RequestRecord(sent_at=0.0)]  # never finished
    summary = summarize(records, duration_s=2.0, nominal_prompt_tokens=50)
    assert (summary["requests"], summary["completed"], summary["errors"]) == (5, 2, 3)
    assert summary["error_kinds"] == {"http 500": 1, "timeout": 1, "unfinished": 1}
    assert summary["output_tokens"] == 7 and summary["prompt_tokens"] == 150
    assert summary["request_throughput"] == 1.0
    assert summary["output_throughput_tok_s"] == 3.5
    assert summary["total_token_throughput"] == 78.5
    assert summary["ttft_ms"]["count"] == 2 and summary["itl_ms"]["count"] == 3
    assert summary["text_chunks"] == 5


def test_goodput_counts_requests_within_both_slo_bounds_over_all_requests() -> None:
    records = [_record(0.0, [0.1, 0.2, 0.3], tokens=3),  # TTFT 100 ms, TPOT ~100 ms: met
               _record(0.0, [0.3, 0.35], tokens=2),  # TTFT 300 ms: missed
               _record(0.0, [0.1, 0.5], tokens=2),  # TPOT ~401 ms: missed
               _record(0.0, [0.2], tokens=1),  # one token: TTFT alone counts, met
               RequestRecord(sent_at=0.0, error="http 500")]  # a failure never meets it
    summary = summarize(records, duration_s=2.0, nominal_prompt_tokens=50, slo=Slo(ttft_ms=250, itl_ms=150))
    assert summary["slo"] == {"ttft_ms": 250, "itl_ms": 150, "met": 2, "attainment": 0.4, "goodput_rps": 1.0}
    assert "slo" not in summarize(records, duration_s=2.0, nominal_prompt_tokens=50)
    assert ratios(summary, {"slo": {"goodput_rps": 2.0, "attainment": 0.8}})["goodput"] == 0.5
    for bad in ((0, 10), (10, -1)):
        with pytest.raises(ValueError, match="positive"):
            Slo(*bad)


def test_per_request_figures_trace_each_request_in_sending_order_only_when_asked() -> None:
    records = [_record(11.0, [11.3, 11.35, 11.95], tokens=3),
               _record(10.0, [10.2, 10.22], tokens=2),
               RequestRecord(sent_at=12.0, error="http 500")]
    assert "per_request" not in summarize(records, duration_s=2.0, nominal_prompt_tokens=50)
    rows = summarize(records, duration_s=2.0, nominal_prompt_tokens=50, per_request=True)["per_request"]
    assert rows == [
        {"sent_ms": 0.0, "ttft_ms": 200.0, "itl_ms": [20.0], "output_tokens": 2, "error": None},
        {"sent_ms": 1000.0, "ttft_ms": 300.0, "itl_ms": [50.0, 600.0], "output_tokens": 3, "error": None},
        {"sent_ms": 2000.0, "ttft_ms": None, "itl_ms": [], "output_tokens": 0, "error": "http 500"}]


def test_ratios_are_first_over_second() -> None:
    first = {"ttft_ms": {"p50": 30.0, "p90": 60.0}, "output_throughput_tok_s": 50.0}
    second = {"ttft_ms": {"p50": 10.0, "p90": 0.0}, "output_throughput_tok_s": 100.0}
    result = ratios(first, second)
    assert result["ttft_p50"] == 3.0 and result["output_throughput"] == 0.5
    assert result["ttft_p90"] is None and result["itl_p50"] is None


# ---- topologies ------------------------------------------------------------------------------


def test_topology_names() -> None:
    def roles(name: str) -> list[tuple[str, WorkerRole]]:
        return [(spec.worker_id, spec.role) for spec in worker_specs(parse_topology(name), "sim", ())]

    assert roles("1p1d") == [("prefill-1", WorkerRole.PREFILL), ("decode-1", WorkerRole.DECODE)]
    assert roles("2P3D").count(("decode-3", WorkerRole.DECODE)) == 1
    assert [role for _, role in roles("3x1")] == [WorkerRole.BOTH] * 3
    assert parse_topology("2p2d").router_settings == ALWAYS_DISAGGREGATE
    assert parse_topology("2x1").router_settings == {}
    assert parse_topology("2xVLLM") == Topology(name="2xvllm", peer=2)
    for bad in ("", "1p", "0p1d", "1p0d", "0x1", "2x2", "tp2", "0xvllm", "vllm"):
        with pytest.raises(ValueError):
            parse_topology(bad)


def test_compare_needs_two_distinct_topologies() -> None:
    assert [topology.name for topology in parse_topologies("1p1d, 2x1")] == ["1p1d", "2x1"]
    for bad in ("1p1d", "2x1,2x1"):
        with pytest.raises(ValueError):
            parse_topologies(bad)


def test_vllm_workers_are_pinned_round_robin() -> None:
    settings = {"max_model_len": 4096, "vllm_kv_cache_gib": 0.5}
    specs = worker_specs(parse_topology("2p1d"), "vllm", cores=[4, 5], worker_settings=settings)
    assert [spec.engine_args[2:] for spec in specs] == [("--vllm-cpu-threads-bind", core) for core in ("4", "5", "4")]
    assert all(spec.settings == settings for spec in specs)
    worker = worker_args(StackConfig(model_dir="m", workers=specs), "nats://n", specs[0])
    assert worker[-4:] == ["--max-model-len", "4096", "--vllm-kv-cache-gib", "0.5"]  # after the engine's: they win
    assert all(spec.engine_args == () for spec in worker_specs(parse_topology("2x1"), "sim", cores=[0]))


def test_the_vllm_peer_gets_the_workers_engine_settings_one_core_each() -> None:
    options = VllmEngineOptions(model_dir="/models/m", kv_cache_gib=0.5, max_model_len=4096)
    argv = server_argv(options, 9001, python="py")
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert argv[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert (flags["--port"], flags["--model"], flags["--served-model-name"]) == ("9001", "/models/m", "m")
    assert flags["--kv-cache-memory-bytes"] == str(1 << 29) and flags["--max-model-len"] == "4096"
    assert flags["--max-num-batched-tokens"] == str(options.max_num_batched_tokens)
    assert {"--enforce-eager", "--enable-prefix-caching"} <= set(argv) and "--block-size" not in argv
    assert [PeerPlan(2, options, cores=[5, 4]).core_of(index) for index in range(3)] == ["4", "5", "4"]
    assert PeerPlan(1, options).core_of(0) == "auto"
    router = router_argv("vllm-router", 9000, 9009, ["http://127.0.0.1:9001", "http://127.0.0.1:9002"])
    assert router[router.index("--policy") + 1] == "round_robin"
    assert router[router.index("--worker-urls") + 1:] == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]


def test_an_any_arm_prices_interference_from_the_slo_and_on_the_sim_its_budget_too() -> None:
    """`Nxany`'s router settings: `itl_weight` from the SLOs; `itl_budget_tokens` from the
    sim's packaged timing profile (a full step of 15.4 ms against 55 ms, over 64 tokens, at
    0.05 ms per prompt token), 0 on vLLM, whose timings the bench does not know."""
    from bench.serve.interference import interference_settings

    slo = Slo(ttft_ms=4000, itl_ms=55)
    sim = interference_settings(slo, 64, engine="sim")
    assert sim == {"itl_weight": 1.136, "itl_budget_tokens": 50688}
    assert interference_settings(slo, 64, engine="sim", sim_speedup=2.0)["itl_budget_tokens"] > 50688
    assert interference_settings(slo, 64, engine="vllm") == {"itl_weight": 1.136, "itl_budget_tokens": 0.0}
    assert interference_settings(None, 64, engine="sim") == {"itl_weight": 1.0, "itl_budget_tokens": 0.0}
    arm = dataclasses.replace(parse_topology("4xany"), **sim)
    assert arm.router_settings == {"prefill_from": "any", "itl_weight": 1.136, "itl_budget_tokens": 50688}
    assert "itl_budget_tokens" not in parse_topology("4x1").router_settings
