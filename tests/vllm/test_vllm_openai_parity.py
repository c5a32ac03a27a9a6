"""Tandem answers like vLLM's own OpenAI server: the same OpenAI requests, on the same
generated tiny model, asked of `python -m vllm.entrypoints.openai.api_server` and of a
Tandem stack with vLLM workers in P/D (1 prefill + 1 decode, every request split), compared
field by field (text, finish_reason, usage, model, object, choice index, chat role),
streamed and not (tests/vllm/parity.py says what is compared and what legitimately differs).

The box has two cores: vLLM's server runs first, on the first core with a Tandem worker's
engine settings, answers every case, and is stopped; only then does the P/D pair start
(prefill on the first core, decode on the second). Greedy decoding (temperature 0, a fixed
seed) makes the answers deterministic.

Both servers read tool calls in the Hermes format (the tiny model's template writes them
so): vLLM's with --enable-auto-tool-choice --tool-call-parser hermes, Tandem's router with
--tool-call-parser hermes.

`RESPONSES_CASES` ask `/v1/responses` the same way (vLLM's server with its response store
on, for `previous_response_id` and retrieve).

`CASES` and `RESPONSES_CASES` are data, in `tests/vllm/parity_cases.py`: one row per
request. To cover a new field (logit_bias, top_k, logprobs, ...), append a row there.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv (make install-vllm)")

from launch.stack import LocalStack  # noqa: E402
from services.worker.vllm.options import VllmEngineOptions  # noqa: E402
from shared.nats_server import EmbeddedNats  # noqa: E402
from tests.stack_fixtures import records_arrived, request_records  # noqa: E402
from tests.vllm.conftest import BLOCK, cores, pd_pair  # noqa: E402
from tests.vllm.lm_eval_task import Scores, run_lm_eval, write_task  # noqa: E402
from tests.vllm.observer import disaggregated_requests  # noqa: E402
from tests.vllm.parity import (  # noqa: E402
    Answer,
    ParityCase,
    ResponsesAnswer,
    ResponsesCase,
    ask,
    ask_responses,
    assert_answers_like_vllm,
    responses_differences,
    unmet_expectations,
    vllm_openai_server,
)
from tests.vllm.parity_cases import (  # noqa: E402
    CASES,
    LONG_TEXT,
    RESPONSES_CASES,
    TANDEM_TOOL_PARSER,
    TOOLS,
    VERDICT,
    VLLM_JSON_SCHEMA_TOOL_CALLS,
    VLLM_RESPONSES_STORE,
    VLLM_TOOL_PARSER,
)

pytestmark = pytest.mark.e2e

KV_CACHE_GIB = 0.25  # what pd_pair's workers get (tests/vllm/conftest.py `vllm_args`)
STREAMING = (False, True)
CASE_MODES = [(case, stream) for case in CASES for stream in STREAMING if case.streamed or not stream]


@pytest.fixture(scope="module")
def model_name(tiny_model_dir: str) -> str:
    return VllmEngineOptions(model_dir=tiny_model_dir).model_name  # both serve the directory's name


@pytest.fixture(scope="module")
def lm_eval_task(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (make install-vllm installs it)")
    return write_task(tmp_path_factory.mktemp("lm-eval-task"))


@dataclass
class VllmReference:
    answers: dict[tuple[str, bool], Answer]
    responses: dict[tuple[str, bool], tuple[ResponsesAnswer, ...]]
    lm_eval: Scores


@pytest.fixture(scope="module")
async def vllm_reference(tiny_model_dir: str, model_name: str, lm_eval_task: Path,
                         tmp_path_factory: pytest.TempPathFactory) -> VllmReference:
    """vLLM's own server's answer to every case, streamed and not, and lm-eval's scores
    through it; the server is stopped (nothing of it left) before this returns."""
    options = VllmEngineOptions(model_dir=tiny_model_dir, cpu_threads_bind=str(cores()[0]),
                                kv_cache_gib=KV_CACHE_GIB, json_any_whitespace=False)
    answers: dict[tuple[str, bool], Answer] = {}
    responded: dict[tuple[str, bool], tuple[ResponsesAnswer, ...]] = {}
    with vllm_openai_server(options, tmp_path_factory.mktemp("vllm-openai"), VLLM_TOOL_PARSER,
                            {**VLLM_JSON_SCHEMA_TOOL_CALLS, **VLLM_RESPONSES_STORE}) as url:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            for case, stream in CASE_MODES:
                answers[case.id, stream] = await ask(client, case, model_name, stream=stream)
            for responses_case in RESPONSES_CASES:
                for stream in STREAMING:
                    responded[responses_case.id, stream] = await ask_responses(
                        client, responses_case, model_name, stream=stream, of_vllm=True)
        scores = await asyncio.to_thread(run_lm_eval, f"{url}/v1/completions", model_name, tiny_model_dir,
                                         lm_eval_task)
    return VllmReference(answers, responded, scores)


@pytest.fixture(scope="module")
def pd_stack(vllm_reference: VllmReference, nats_server: EmbeddedNats, tiny_model_dir: str,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """Starts only once vLLM's server is gone (it depends on its answers)."""
    no_json_whitespace = ("--no-vllm-json-whitespace",)  # as the vLLM server's engine
    yield from pd_pair(nats_server, tiny_model_dir, tmp_path_factory.mktemp("parity-1p1d"),
                       decode_args=no_json_whitespace, prefill_args=no_json_whitespace, router_args=TANDEM_TOOL_PARSER)


@pytest.mark.parametrize(("case", "stream"), CASE_MODES,
                         ids=[f"{case.id}-{'streamed' if stream else 'whole'}" for case, stream in CASE_MODES])
async def test_tandem_answers_like_vllm(case: ParityCase, stream: bool, vllm_reference: VllmReference,
                                        pd_stack: LocalStack, openai_client, model_name: str) -> None:
    await assert_answers_like_vllm(case, stream, vllm_reference.answers[case.id, stream],
                                   openai_client(pd_stack.router_url, timeout=120), pd_stack.router_url, model_name)


@pytest.mark.parametrize("stream", STREAMING, ids=("whole", "streamed"))
@pytest.mark.parametrize("case", RESPONSES_CASES, ids=[case.id for case in RESPONSES_CASES])
async def test_tandem_responds_like_vllm(case: ResponsesCase, stream: bool, vllm_reference: VllmReference,
                                         pd_stack: LocalStack, openai_client, model_name: str) -> None:
    """`/v1/responses` through the openai client: every turn (and the first, retrieved)
    compared field by field, streamed events in their order; each turn split in P/D."""
    reference = vllm_reference.responses[case.id, stream]
    unmet = unmet_expectations(case, reference[0])
    assert not unmet, f"{case.id}: vLLM's answer no longer exercises what the case is for: {unmet}"
    split_before = await disaggregated_requests(pd_stack.router_url)

    answers = await ask_responses(openai_client(pd_stack.router_url, timeout=120), case, model_name, stream=stream)

    split = await disaggregated_requests(pd_stack.router_url) - split_before
    assert split == 1 + len(case.follow_ups), f"{case.id}: split {split} times, expected one per turn"
    mismatched = responses_differences(reference, answers)
    assert not mismatched, f"{case.id} ({'streamed' if stream else 'whole'}): " + "; ".join(mismatched)


async def test_lm_eval_scores_and_generates_as_against_vllm(vllm_reference: VllmReference, pd_stack: LocalStack,
                                                             tiny_model_dir: str, model_name: str,
                                                             lm_eval_task: Path) -> None:
    """lm-evaluation-harness's `local-completions` runs a multiple-choice task (log-likelihoods
    of 48 choices from echoed prompts) and a greedy generation task (10 documents) against
    Tandem: every log-likelihood within 1e-3 of vLLM's server's, every generation equal."""
    scores = await asyncio.to_thread(run_lm_eval, f"{pd_stack.router_url}/v1/completions", model_name,
                                     tiny_model_dir, lm_eval_task)
    reference = vllm_reference.lm_eval
    assert len(scores.loglikelihoods) == len(reference.loglikelihoods) == 48
    assert scores.metrics == reference.metrics
    gaps = sorted(abs(ours - theirs) for ours, theirs in zip(scores.loglikelihoods, reference.loglikelihoods))
    print(f"lm-eval log-likelihoods, Tandem 1P1D against vLLM's server: largest difference {gaps[-1]:.2e}, "
          f"{sum(gap > 1e-3 for gap in gaps)} of {len(gaps)} over 1e-3")
    assert gaps[-1] <= 1e-3, f"log-likelihoods differ by up to {gaps[-1]}"
    assert len(scores.generations) == 10 and any(scores.generations)
    assert scores.generations == reference.generations


async def test_json_schema_output_parses_and_validates_every_time(pd_stack: LocalStack, openai_client,
                                                                  model_name: str) -> None:
    """20 chats on different topics with `response_format` `json_schema`: every answer is JSON
    valid against the schema, each split between the prefill and the decode worker (the decode
    worker replays the first token through the grammar). The workers leave whitespace out of
    structured JSON (--no-vllm-json-whitespace): with it allowed, random weights write
    whitespace until max_tokens, on vLLM's server too."""
    jsonschema = pytest.importorskip("jsonschema")
    client = openai_client(pd_stack.router_url, timeout=120)
    split_before = await disaggregated_requests(pd_stack.router_url)
    for topic in range(20):
        reply = await client.chat.completions.create(
            model=model_name, max_tokens=64, temperature=0,
            messages=[{"role": "user", "content": f"Is topic number {topic} interesting? Answer as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT}})
        content = reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "stop", (topic, content)
        jsonschema.validate(json.loads(content), VERDICT)
    assert await disaggregated_requests(pd_stack.router_url) == split_before + 20



async def test_a_required_tool_call_has_arguments_that_parse_as_json(pd_stack: LocalStack, openai_client,
                                                                     model_name: str) -> None:
    """`tool_choice: required` on 10 chats, each split: each answer holds tool calls of the
    tools offered, whose arguments parse as JSON objects valid against the tool's parameters."""
    jsonschema = pytest.importorskip("jsonschema")
    client = openai_client(pd_stack.router_url, timeout=120)
    split_before = await disaggregated_requests(pd_stack.router_url)
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] or {"type": "object"} for tool in TOOLS}
    for topic in range(10):
        reply = await client.chat.completions.create(
            model=model_name, max_tokens=64, temperature=0, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False,
            messages=[{"role": "user", "content": f"What should I pack for trip number {topic}?"}])
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, (topic, choice)
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert await disaggregated_requests(pd_stack.router_url) == split_before + 10


async def test_a_cache_salt_shares_kv_only_with_requests_of_the_same_salt(pd_stack: LocalStack, openai_client,
                                                                         model_name: str) -> None:
    """vLLM's cache_salt through the 1P1D pair: a prompt asked unsalted, then with salt a, b and
    a again (greedy, each split, its KV pulled): salts a and b find nothing of it cached at the
    prefill worker, a again finds a's blocks; the router's index, fed by the workers' KV events,
    tells the salts apart too (with cache_hit_threshold, a fourth salt is answered
    "cache_threshold" and a is served); every answer is the unsalted one."""
    client = openai_client(pd_stack.router_url, timeout=120)

    async def ask_salted(salt: str | None, **fields) -> openai.types.Completion:
        return await client.completions.create(model=model_name, prompt=LONG_TEXT, max_tokens=8, temperature=0,
                                               extra_body={"cache_salt": salt, **fields} if salt else None)

    plain = await ask_salted(None)
    split_before = await disaggregated_requests(pd_stack.router_url)
    async with request_records(pd_stack, "salt-records") as records:
        salted = [await ask_salted(salt) for salt in ("a", "b", "a")]
        refused = await ask_salted("c", cache_hit_threshold=0.3)
        indexed = await ask_salted("a", cache_hit_threshold=0.3)  # a's blocks, as the workers' KV events named them
        await records_arrived(records, 5)
    assert [answer.choices[0].text for answer in salted] == [plain.choices[0].text] * 3
    assert (refused.choices[0].finish_reason, refused.usage.completion_tokens) == ("cache_threshold", 0)
    assert indexed.choices[0].text == plain.choices[0].text
    whole_blocks = plain.usage.prompt_tokens // BLOCK * BLOCK
    assert whole_blocks and [record.cached_tokens for record in records[:3]] == [0, 0, whole_blocks]
    # the three without a threshold split; with one, a is served whole where its blocks are (decode-first)
    assert await disaggregated_requests(pd_stack.router_url) == split_before + 3
