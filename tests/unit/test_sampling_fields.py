"""The request fields of the generate endpoints (`services.router.openai.request_fields`): the request
models are built from the table, docs/openai-api.md shows it, nothing is silently ignored; and the
sampling parameters a continuation (P/D hand-off, resume) gets, and when a request is served
whole on one engine."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from pydantic import ValidationError

from services.router.config import RoutingConfig
from services.router.http.serving import sampling_params
from services.router.openai.errors import BadRequest
from services.router.openai.protocol import ChatCompletionRequest, CompletionRequest
from services.router.openai.request_fields import BOTH, FIELDS, RequestField, fields_of, markdown_table
from services.router.routing import RoutePlan, RouteRequest, WorkerView, decide
from services.worker.sim.tokens import MODELLED_FIELDS, refuse_unmodelled
from shared.errors import InvalidArgument
from shared.schemas import SamplingParams, WorkerRole, WorkerStatus
from shared.schemas.generate import StructuredOutput

OPENAI_API_DOC = Path(__file__).resolve().parents[2] / "docs" / "openai-api.md"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


@pytest.mark.parametrize(("model", "endpoint"), [(CompletionRequest, "completions"), (ChatCompletionRequest, "chat")])
def test_every_declared_field_is_in_the_table_and_every_table_field_is_declared(model, endpoint) -> None:
    assert set(model.model_fields) == set(fields_of(endpoint))


def test_the_openai_api_doc_shows_the_table_as_the_code_has_it() -> None:
    assert markdown_table() in OPENAI_API_DOC.read_text(), (
        "docs/openai-api.md's table is not the code's: regenerate it: python -m services.router.openai.request_fields")


def openai_fields(endpoint: str) -> set[str]:
    """The request fields OpenAI's API defines for `endpoint`, as the official client types them."""
    if endpoint == "chat":
        from openai.types.chat import completion_create_params as params
    else:
        from openai.types import completion_create_params as params
    streaming = params.CompletionCreateParamsStreaming
    return set(streaming.__required_keys__ | streaming.__optional_keys__)


def generate_endpoints(field: RequestField) -> list[str]:
    """The row's endpoints of the two generate ones (its Responses API's: test_responses_translation)."""
    return [endpoint for endpoint in BOTH if endpoint in field.endpoints]


def test_a_refused_field_says_why_and_a_field_only_openai_defines_is_openais() -> None:
    """vLLM's fields are checked against vLLM's own request models where vLLM is installed
    (tests/vllm/test_vllm_request_fields.py); OpenAI's alone against the openai client's."""
    assert not [field.name for field in FIELDS if field.status == "refused unless default" and not field.note]
    for field in FIELDS:
        if field.origin == "openai":
            for endpoint in generate_endpoints(field):
                assert field.name in openai_fields(endpoint), f"{field.name} is not OpenAI's ({endpoint})"


@pytest.mark.parametrize("field", [field for field in FIELDS if field.status == "refused unless default"],
                         ids=lambda field: f"{field.name}-{'-'.join(field.endpoints)}")
def test_a_refused_field_is_accepted_at_its_default_and_named_otherwise(field) -> None:
    for endpoint in generate_endpoints(field):
        model, base = (CompletionRequest, COMPLETION) if endpoint == "completions" else (ChatCompletionRequest, CHAT)
        for allowed in field.allowed:
            model.model_validate({**base, field.name: allowed})
        with pytest.raises(ValidationError) as refused:
            model.model_validate({**base, field.name: "something else"})
        assert refused.value.errors()[0]["loc"] == (field.name,)
        assert "not supported by Tandem" in refused.value.errors()[0]["msg"]


def test_true_is_not_one_and_an_unknown_field_is_refused() -> None:
    with pytest.raises(ValidationError, match="n\n"):
        CompletionRequest.model_validate({**COMPLETION, "n": True})
    with pytest.raises(ValidationError, match="extra_forbidden"):
        ChatCompletionRequest.model_validate({**CHAT, "prompt": "a completions field"})


@pytest.mark.parametrize("stop_token_ids", [[-1], [5, -7], [1000], [999, 4096], [2**31], [2**70]])
def test_stop_token_ids_outside_the_vocabulary_are_a_400_naming_the_field_as_on_vllms_server(stop_token_ids) -> None:
    """vLLM's server takes any integers in its request model and refuses, with a 400 naming
    `stop_token_ids`, those outside [0, vocabulary size) (`SamplingParams._validate_stop_token_ids`),
    negative ones too; so does Tandem (here a vocabulary of 1000), whatever the engine."""
    with pytest.raises((ValidationError, BadRequest)) as refused:
        body = CompletionRequest.model_validate({**COMPLETION, "stop_token_ids": stop_token_ids})
        sampling_params(body, max_tokens=16, vocab_size=1000)
    if isinstance(refused.value, ValidationError):  # negative, or past what the bus carries
        assert refused.value.errors()[0]["loc"][0] == "stop_token_ids"
    else:
        assert refused.value.param == "stop_token_ids" and "[0, 1000)" in refused.value.message


def test_stop_token_ids_of_the_vocabulary_reach_the_workers() -> None:
    body = ChatCompletionRequest.model_validate({**CHAT, "stop_token_ids": [0, 999]})
    assert sampling_params(body, max_tokens=16, vocab_size=1000).stop_token_ids == [0, 999]
    assert sampling_params(ChatCompletionRequest.model_validate(CHAT), 16, 1000).stop_token_ids == []


def test_a_continuation_makes_fewer_tokens_and_needs_fewer_before_a_stop() -> None:
    sampling = SamplingParams(max_tokens=10, min_tokens=4, top_k=5, logit_bias={7: 2.0})
    assert sampling.continued(3) == SamplingParams(max_tokens=7, min_tokens=1, top_k=5, logit_bias={7: 2.0})
    assert sampling.continued(6).min_tokens == 0
    assert sampling.first_token_only() == SamplingParams(max_tokens=1, min_tokens=1, top_k=5, logit_bias={7: 2.0})
    assert SamplingParams(max_tokens=10).first_token_only().min_tokens == 0


@pytest.mark.parametrize(("sampling", "replays"), [
    (SamplingParams(), False),
    (SamplingParams(temperature=0.8), False),  # unseeded: any engine samples as well as another
    (SamplingParams(seed=3), False),  # greedy: the seed changes nothing
    (SamplingParams(temperature=0.8, seed=3), True),  # the seeded stream must draw for the first token too
    (SamplingParams(presence_penalty=0.5), True),
    (SamplingParams(frequency_penalty=-0.5), True),
    (SamplingParams(bad_words=["hello world"]), True),
    (SamplingParams(structured=StructuredOutput(regex="[a-z]+")), True),  # the grammar follows the answer
    (SamplingParams(repetition_penalty=1.3, min_tokens=3, logit_bias={1: 5.0}, top_k=3), False),
])
def test_sampling_on_the_output_history_replays_the_first_token_on_a_decode_part_that_pulls(
        sampling: SamplingParams, replays: bool) -> None:
    assert sampling.depends_on_output_history is replays
    appended, continued = sampling.continue_after([11])
    if replays:  # the prompt stays; the decode engine makes the first token again, then the rest
        assert appended == [] and continued == msgspec.structs.replace(sampling, replayed=[11])
    else:
        assert appended == [11] and continued == sampling.continued(1)
    workers = [WorkerView(worker_id=worker_id, model="m", role=role, status=WorkerStatus.ACTIVE, max_num_seqs=8,
                          max_model_len=1024, reported_load=0, in_flight=0, in_flight_at_report=0, last_routed=0,
                          compat_hash="h", kv_push=True)
               for worker_id, role in (("p", WorkerRole.PREFILL), ("d", WorkerRole.DECODE))]
    request = RouteRequest(model="m", prompt_tokens=500, total_tokens=600, replays=sampling.depends_on_output_history)
    plan = decide(workers, request, RoutingConfig(pd_transfer="push"))
    assert isinstance(plan, RoutePlan)
    assert (plan.flow, plan.prefill_worker_id, plan.worker_id) == ("disaggregated", "p", "d")
    assert plan.transfer == ("pull" if replays else "push")  # the first token exists before the decode part


def test_prompt_log_probabilities_are_served_by_one_engine() -> None:
    sampling = SamplingParams(prompt_logprobs=1)
    assert sampling.needs_whole_prompt and not SamplingParams(logprobs=2).needs_whole_prompt
    workers = [WorkerView(worker_id=worker_id, model="m", role=role, status=WorkerStatus.ACTIVE, max_num_seqs=8,
                          max_model_len=1024, reported_load=0, in_flight=0, in_flight_at_report=0, last_routed=0,
                          compat_hash="h")
               for worker_id, role in (("p", WorkerRole.PREFILL), ("d", WorkerRole.DECODE))]
    plan = decide(workers, RouteRequest(model="m", prompt_tokens=500, total_tokens=600, one_engine=True))
    assert isinstance(plan, RoutePlan)
    assert (plan.flow, plan.reason, plan.worker_id) == ("single", "one_engine_sampling", "d")


def test_the_sim_engine_refuses_what_its_token_model_cannot_honour_naming_each_field() -> None:
    refuse_unmodelled(SamplingParams(max_tokens=5, temperature=0.7, seed=1, stop_token_ids=[3], ignore_eos=True))
    with pytest.raises(InvalidArgument, match="the sim engine does not model top_p, min_tokens"):
        refuse_unmodelled(SamplingParams(top_p=0.5, min_tokens=2))
    assert MODELLED_FIELDS < set(SamplingParams.__struct_fields__)


def test_whitespace_in_structured_json_is_a_worker_setting_not_a_request_field() -> None:
    with pytest.raises(ValidationError, match="--no-vllm-json-whitespace"):
        CompletionRequest.model_validate({**COMPLETION, "structured_outputs": {"json": {}, "disable_any_whitespace": True}})
    CompletionRequest.model_validate({**COMPLETION, "structured_outputs": {"json": {}, "disable_any_whitespace": False}})


def test_a_worker_without_json_whitespace_tells_vllm_so_and_its_peer_server_too(tmp_path: Path) -> None:
    from bench.serve.peer import server_argv
    from services.worker.vllm.config import VllmEngineConfig
    from services.worker.vllm.options import VllmEngineOptions
    from shared.config import WorkerConfig

    config = WorkerConfig(worker_id="w", engine="vllm", model_dir=str(tmp_path))
    options = VllmEngineOptions.from_worker_config(config, VllmEngineConfig(json_any_whitespace=False))
    assert options.json_any_whitespace is False
    assert server_argv(options, 8000)[-2:] == ["--structured-outputs-config",
                                                '{"backend": "xgrammar", "disable_any_whitespace": true}']
