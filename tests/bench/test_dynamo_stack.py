"""`bench.routing.dynamo` (+ `dynamo_counters`, `dynamo_drive`, `dynamo_timing`): NVIDIA
Dynamo's frontend, KV router and mocker workers beside Tandem.

The stack tests start the real thing (nats-server, `python -m dynamo.mocker`, `python -m
dynamo.frontend`) from the Dynamo venv named by $TANDEM_DYNAMO_VENV (made as
../shared/DESIGN.md section 10 says, outside the repository). Without it they are skipped,
saying so: CI has no Dynamo venv, so there they always skip; that is expected. The other
tests (counters parsing, the mocker's timing profile, the missing-venv error) run anywhere.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path

import numpy as np
import openai
import pytest

from bench.routing.dynamo import VENV_ENV, DynamoStack, DynamoUnavailable, dynamo_client, dynamo_python
from bench.routing.dynamo_counters import parse_counters, parse_router_counters
from bench.routing.dynamo_drive import stream_answer
from bench.routing.dynamo_timing import mocker_settings, polynomial_speedup, profile_arrays
from bench.routing.workloads import EngineShape, Outcome
from services.worker.sim.profile import TimingProfile, load_profile
from tests.stack_fixtures import group_members

VENV = os.environ.get(VENV_ENV, "")
needs_dynamo = pytest.mark.skipif(
    not VENV or not (Path(VENV) / "bin" / "python").exists(),
    reason=f"no Dynamo venv: set {VENV_ENV} to one made as DESIGN.md section 10 says (CI has none)")


def _left_over(pgids: list[int]) -> dict[int, list[int]]:
    return {pgid: members for pgid in pgids if (members := group_members(pgid))}


@pytest.fixture
def marker(monkeypatch: pytest.MonkeyPatch) -> str:
    """An environment entry the stack's children inherit: finds them without knowing pids."""
    value = f"dynamo-test-{uuid.uuid4().hex}"
    monkeypatch.setenv("TANDEM_TEST_MARKER", value)
    return value


def _marked(marker: str) -> list[int]:
    """Live processes (other than this one) whose environment carries `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in environ and state != "Z":
            found.append(int(entry.name))
    return found


# ---- against the real Dynamo -------------------------------------------------------------------


@needs_dynamo
def test_streams_a_token_id_prompt_through_the_kv_router_and_leaves_nothing(tiny_model_dir: str, tmp_path: Path,
                                                                            marker: str) -> None:
    prompt = list(range(100, 168))  # four full 16-token blocks and 4 tokens
    with DynamoStack(tiny_model_dir, workers=2, kv_blocks=64, router_mode="kv", log_dir=tmp_path) as stack:
        pgids = list(stack.pids)
        state_dir = stack._state_dir
        assert stack.router_counters()["registered_workers"] == 2
        before = stack.counters()
        client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=30)
        answers = []
        for _ in range(2):
            text, usage = "", None
            for chunk in client.completions.create(model=stack.model, prompt=prompt, max_tokens=8, temperature=0,
                                                   stream=True, stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True}):
                text += "".join(choice.text for choice in chunk.choices)
                usage = chunk.usage or usage
            answers.append((text, usage))
        client.close()
        used = stack.counters() - before
    for text, usage in answers:
        assert text.strip()
        assert usage is not None and usage.completion_tokens == 8 and usage.prompt_tokens == len(prompt)
    # the second request went where the first left its blocks: all four full blocks cached
    assert answers[0][1].prompt_tokens_details.cached_tokens == 0
    assert answers[1][1].prompt_tokens_details.cached_tokens == 64
    assert (used.requests, used.prompt_tokens, used.cached_tokens) == (2, 136, 64)
    assert _left_over(pgids) == {} and _marked(marker) == []
    assert state_dir is not None and not state_dir.exists()
    assert {"mocker.log", "frontend.log"} <= {path.name for path in tmp_path.iterdir()}


@needs_dynamo
async def test_stream_answer_returns_the_served_token_ids_for_the_next_turn(tiny_model_dir: str) -> None:
    with DynamoStack(tiny_model_dir, workers=1, kv_blocks=64) as stack:
        async with dynamo_client(stack.base_url) as client:
            first = Outcome(sent_at=time.monotonic())
            answer = await stream_answer(client, stack.model, list(range(100, 168)), 12, first)
            before = await asyncio.to_thread(stack.counters)
            second = Outcome(sent_at=time.monotonic())
            await stream_answer(client, stack.model, list(range(100, 168)) + answer + [7] * 20, 4, second)
            used = await asyncio.to_thread(stack.counters) - before
    assert first.error is None and first.ttft_s is not None and first.completion_tokens == 12
    assert len(answer) == 12 and all(isinstance(token, int) for token in answer)
    assert second.error is None
    assert used.cached_tokens == 64  # the first prompt's four blocks; the mocker caches no answer blocks


@needs_dynamo
def test_an_interrupt_inside_the_block_still_stops_everything(tiny_model_dir: str, marker: str) -> None:
    pgids: list[int] = []
    with pytest.raises(KeyboardInterrupt):
        with DynamoStack(tiny_model_dir, router_mode="round-robin", **mocker_settings(_shape(2))) as stack:
            pgids = list(stack.pids)
            assert len(pgids) == 3 and len(_marked(marker)) >= 3
            raise KeyboardInterrupt
    assert _left_over(pgids) == {} and _marked(marker) == []


@needs_dynamo
def test_a_start_that_times_out_leaves_nothing(tiny_model_dir: str, marker: str) -> None:
    stack = DynamoStack(tiny_model_dir, workers=2, start_timeout_s=0.01)
    with pytest.raises(TimeoutError, match="no 2 mocker workers registered"):
        stack.start()
    assert stack.processes == {} and stack.nats is None and _marked(marker) == []


# ---- anywhere ------------------------------------------------------------------------------------


def test_a_missing_venv_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VENV_ENV, raising=False)
    with pytest.raises(DynamoUnavailable, match=VENV_ENV):
        dynamo_python()
    with pytest.raises(DynamoUnavailable, match="does not exist"):
        dynamo_python(tmp_path / "nowhere")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").touch()
    with pytest.raises(DynamoUnavailable, match="ai-dynamo==1.6.1"):
        dynamo_python(tmp_path)


METRICS = """\
# TYPE dynamo_frontend_input_sequence_tokens histogram
dynamo_frontend_input_sequence_tokens_bucket{model="m",le="+Inf"} 3
dynamo_frontend_input_sequence_tokens_sum{model="m"} 3215
dynamo_frontend_input_sequence_tokens_count{model="m"} 3
# TYPE dynamo_frontend_cached_tokens histogram
dynamo_frontend_cached_tokens_bucket{model="m",le="+Inf"} 3
dynamo_frontend_cached_tokens_sum{model="m"} 1600
dynamo_frontend_cached_tokens_count{model="m"} 3
# TYPE dynamo_component_router_kv_selected_cached_prefix_tokens_total counter
dynamo_component_router_kv_selected_cached_prefix_tokens_total{router_id="1",worker_id="a"} 1584
# TYPE dynamo_component_router_worker_registered gauge
dynamo_component_router_worker_registered{router_worker_id="11",worker_id="a"} 1
dynamo_component_router_worker_registered{router_worker_id="12",worker_id="a"} 1
dynamo_component_router_worker_registered{router_worker_id="13",worker_id="a"} 0
"""


def test_counters_are_the_frontends_prompt_and_cached_token_sums() -> None:
    counters = parse_counters(METRICS)
    assert (counters.requests, counters.prompt_tokens, counters.cached_tokens) == (3, 3215, 1600)
    run = counters - parse_counters("")
    assert run == counters and run.cached_share == pytest.approx(1600 / 3215)
    assert parse_counters("").cached_share is None
    assert parse_router_counters(METRICS) == {"predicted_cached_tokens": 1584, "registered_workers": 2}


def _shape(workers: int = 4, speedup: float = 0.25) -> EngineShape:
    return EngineShape(workers=workers, block_size=16, max_num_batched_tokens=512, max_model_len=2048,
                       profile=load_profile(""), sim_speedup=speedup)


def _interp2(arrays: dict[str, np.ndarray], active: float, context: float) -> float:
    """Bilinear interpolation as the mocker does it, inside the grid."""
    xs, ys, grid = arrays["decode_active_kv_tokens"], arrays["decode_context_length"], arrays["decode_itl"]
    along_y = [np.interp(context, ys, row) for row in grid]
    return float(np.interp(active, xs, along_y))


def test_the_mocker_profile_reproduces_the_sims_step_times() -> None:
    profile = TimingProfile(prefill_ms_per_token=0.05, step_overhead_ms=1.0, decode_base_ms=8.0, decode_ms_per_seq=0.1)
    arrays = profile_arrays(profile, block_size=16, max_context=2048, max_kv_tokens=300 * 16)
    for tokens in (1, 64, 512, 8192):
        ms = np.interp(tokens, arrays["prefill_isl"], arrays["prefill_ttft_ms"])
        assert ms == pytest.approx(profile.step_overhead_ms + tokens * profile.prefill_ms_per_token)
    for seqs, context in ((1, 100), (4, 1600), (8, 2048), (30, 160)):
        expected = profile.step_overhead_ms + profile.decode_base_ms + profile.decode_ms_per_seq * seqs
        assert _interp2(arrays, seqs * context, context) == pytest.approx(expected, abs=profile.decode_ms_per_seq)


def test_mocker_settings_carry_the_shape() -> None:
    shape = _shape()
    settings = mocker_settings(shape, max_num_seqs=64)
    assert settings["speedup_ratio"] == 0.25 and settings["timing_profile"] == shape.profile
    assert (settings["workers"], settings["block_size"], settings["max_num_batched_tokens"],
            settings["max_model_len"], settings["max_num_seqs"]) == (4, 16, 512, 2048, 64)


def test_the_polynomial_speedup_matches_the_sims_uncached_request_time() -> None:
    shape = _shape()
    speedup, decode_speedup = polynomial_speedup(shape, 1600, decode_utilisation=0.5, decoding_seqs=4)
    # 3 x 512 + 64 prompt tokens: four passes of the mocker's polynomials, each with a decode
    poly_ms = 3 * (4.209989e-07 * 512**2 + 1.518344e-02 * 512 + 16.50142) + (
        4.209989e-07 * 64**2 + 1.518344e-02 * 64 + 16.50142)
    decode_ms = -25.74 * 0.25 + 54.01 * 0.5 + 5.74
    mocker_s = (poly_ms / speedup + 4 * decode_ms / (speedup * decode_speedup)) / 1000.0
    assert mocker_s == pytest.approx(shape.uncached_request_s(1600))
    assert decode_ms / (speedup * decode_speedup) == pytest.approx((1.0 + 8.0 + 0.4) / 0.25)
