"""`/v1/responses` through the real router, a real nats-server (its JetStream bucket holding the
stored responses) and real sim workers, driven by the official openai client: text, instructions,
structured output, function tools, the streamed events in their order, retrieve,
`previous_response_id`, `store: false`, and a 400 naming every field Tandem does not honour.

Where a test needs an answer of a chosen text (a tool call, a JSON object), its worker's engine
is the real sim engine whose tokens are replaced by that text's (`ScriptedSimEngine`): the
router, the request plane and the worker service are real."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator

import msgspec
import openai
import pytest

from connector.port import LayerHook
from services.router.config import ResponsesConfig
from services.router.flows.detokenizer import answer_text
from services.router.flows.responses_store import JetStreamResponseStore
from services.router.openai.protocol_responses import ResponsesRequest
from services.router.openai.responses_objects import StoredResponse
from services.router.openai.responses_translation import ResponseDraft, usage_of
from services.worker.engine import EngineOutput
from services.worker.engines import engine_spec
from services.worker.main import build_kv
from services.worker.service import WorkerService
from services.worker.sim.config import SimEngineConfig
from services.worker.sim.engine import SimEngine
from shared.bus import Bus, connect
from shared.config import BusConfig, WorkerConfig
from shared.schemas import SamplingParams
from shared.tokenizer import Tokenizer
from tests.integration import router_cluster as cluster
from tests.integration.router_cluster import MODEL_DIR_NAME
from tests.waiting import wait_for

PROMPT = "Hello there, tell me about the river that runs past the old mill in the valley."
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
WEATHER_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


class ScriptedSimEngine(SimEngine):
    """The sim engine, answering every request with `script`'s tokens and finishing with stop."""

    def __init__(self, config: WorkerConfig, sim: SimEngineConfig, *, model_name: str, vocab_size: int,
                 script: list[int]) -> None:
        super().__init__(config, sim, model_name=model_name, vocab_size=vocab_size)
        self.script = script

    def generate(self, request_id: str, token_ids: list[int], sampling: SamplingParams, *,
                 on_layer: LayerHook | None = None, adapter: str = "", cache_salt: str = "",
                 images=()) -> AsyncGenerator[EngineOutput, None]:
        own = msgspec.structs.replace(sampling, structured=None, max_tokens=len(self.script), ignore_eos=True)
        return self._scripted(super().generate(request_id, token_ids, own, on_layer=on_layer, adapter=adapter,
                                               cache_salt=cache_salt, images=images))

    async def _scripted(self, outputs: AsyncGenerator[EngineOutput, None]) -> AsyncIterator[EngineOutput]:
        sent = 0
        async for output in outputs:
            tokens = self.script[sent:sent + len(output.token_ids)]
            sent += len(tokens)
            finish = "stop" if output.finish_reason is not None else None
            yield msgspec.structs.replace(output, token_ids=tokens, finish_reason=finish)


@pytest.fixture
async def router(bus_config: BusConfig, model_dir: str) -> AsyncIterator[cluster.Router]:
    """A router reading hermes tool calls, its responses kept in its cluster's JetStream bucket."""
    config = cluster.router_config(bus_config, model_dir, tool_call_parser="hermes")
    async with cluster.running_router(config) as running:
        yield running


@pytest.fixture
async def scripted_worker(bus: Bus, bus_config: BusConfig, model_dir: str, tokenizer: Tokenizer):
    """Start the one worker of a test, answering `text` to every request."""
    workers: list[cluster.SimWorker] = []

    async def start(text: str) -> cluster.SimWorker:
        config = cluster.worker_config("scripted", bus_config, model_dir)
        recorder = cluster.Recorder(bus, config.worker_id)
        await recorder.start(config.bus.subjects, generate=True)
        worker = cluster.SimWorker(config.worker_id, recorder, bus, config.bus)
        workers.append(worker)
        spec = engine_spec(config.engine)
        engine = ScriptedSimEngine(config, cluster.SIM, model_name=tokenizer.model_name,
                                   vocab_size=tokenizer.vocab_size,
                                   script=[token for token in tokenizer.encode(text)
                                           if token != tokenizer.bos_token_id])
        worker.bus = await connect(config.bus.nats_url, f"worker-{config.worker_id}")
        await engine.start()
        worker.service = WorkerService(config, engine, worker.bus, build_kv(config, spec, engine, worker.bus),
                                       capabilities=spec.capabilities)
        await worker.service.start()
        return worker

    yield start
    try:
        await cluster.check_idle(workers)
    finally:
        for worker in workers:
            await worker.shutdown()


def chat_prompt(tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tools=tools))
    bos = tokenizer.bos_token_id
    return ids[1:] if bos is not None and ids[:2] == [bos, bos] else ids


async def sim_answer(worker: cluster.SimWorker, tokenizer: Tokenizer, count: int) -> str:
    await wait_for(lambda: len(worker.requests) == count, cluster.DEADLINE_S, f"request {count}")
    return answer_text(tokenizer, cluster.reference_tokens(worker.requests[-1], tokenizer.vocab_size))


# ---- create ----------------------------------------------------------------------------


async def test_a_text_response_with_instructions_is_the_chat_answer_to_them(
        router: cluster.Router, start_worker, tokenizer: Tokenizer) -> None:
    worker = await start_worker()
    await cluster.wait_for_workers(router, 1)

    response = await router.client.responses.create(model=MODEL_DIR_NAME, input=PROMPT, instructions="Be brief.",
                                                    max_output_tokens=5, temperature=0.5, extra_body={"seed": 7},
                                                    metadata={"case": "text"})
    sent = worker.requests[-1]
    assert sent.token_ids == chat_prompt(tokenizer, [{"role": "system", "content": "Be brief."},
                                                     {"role": "user", "content": PROMPT}])
    assert (sent.sampling.max_tokens, sent.sampling.temperature, sent.sampling.seed) == (5, 0.5, 7)
    assert response.id.startswith("resp_") and response.object == "response" and response.created_at > 0
    assert response.output_text == await sim_answer(worker, tokenizer, 1)
    [message] = response.output
    assert (message.type, message.role, message.content[0].type) == ("message", "assistant", "output_text")
    # cut by max_output_tokens: incomplete, as vLLM's server answers
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == len(sent.token_ids)
    assert (response.usage.output_tokens, response.usage.total_tokens) == (5, len(sent.token_ids) + 5)
    assert response.usage.input_tokens_details.cached_tokens == 0
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    assert (response.instructions, response.metadata, response.max_output_tokens) == ("Be brief.", {"case": "text"}, 5)


async def test_input_items_become_the_chat_messages(router: cluster.Router, start_worker,
                                                    tokenizer: Tokenizer) -> None:
    worker = await start_worker()
    await cluster.wait_for_workers(router, 1)
    items = [{"role": "user", "content": [{"type": "input_text", "text": "What is the weather "},
                                          {"type": "input_text", "text": "in Oslo?"}]},
             {"type": "function_call", "call_id": "call-1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call_output", "call_id": "call-1", "output": "Snow, -3 C"}]
    await router.client.responses.create(model=MODEL_DIR_NAME, input=items, tools=[WEATHER_TOOL],
                                         tool_choice="none", max_output_tokens=3)
    # the parts joined by a newline for this template, as vLLM's server joins them (parity case responses-input-parts)
    expected = [{"role": "user", "content": "What is the weather \nin Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call-1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                {"role": "tool", "tool_call_id": "call-1", "content": "Snow, -3 C"}]
    chat_tool = {"type": "function", "function": {key: WEATHER_TOOL[key]
                                                  for key in ("name", "description", "parameters")}}
    assert worker.requests[-1].token_ids == chat_prompt(tokenizer, expected, tools=[chat_tool])


async def test_a_function_tool_answers_function_call_items(router: cluster.Router, scripted_worker) -> None:
    await scripted_worker(WEATHER_CALL)
    await cluster.wait_for_workers(router, 1)

    response = await router.client.responses.create(model=MODEL_DIR_NAME, input="Weather in Oslo?",
                                                    tools=[WEATHER_TOOL], max_output_tokens=64)
    assert response.status == "completed"
    [call] = response.output
    assert (call.type, call.name, json.loads(call.arguments), call.status) == (
        "function_call", "get_weather", {"city": "Oslo"}, "completed")
    assert call.call_id and call.id.startswith("fc_")
    assert [tool.name for tool in response.tools] == ["get_weather"] and response.tool_choice == "auto"


async def test_text_format_json_schema_is_the_routers_structured_output(router: cluster.Router,
                                                                        scripted_worker) -> None:
    worker = await scripted_worker('{"answer": 42}')
    await cluster.wait_for_workers(router, 1)
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}

    response = await router.client.responses.create(
        model=MODEL_DIR_NAME, input="The answer?", max_output_tokens=32,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
    assert json.loads(worker.requests[-1].sampling.structured.json_schema) == schema
    assert json.loads(response.output_text) == {"answer": 42}
    assert response.text.format.type == "json_schema"

    await router.client.responses.create(model=MODEL_DIR_NAME, input="JSON?", max_output_tokens=32,
                                         text={"format": {"type": "json_object"}})
    assert worker.requests[-1].sampling.structured.json_object


# ---- streamed ----------------------------------------------------------------------------


TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added"]
TEXT_DONE = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


async def test_a_streamed_response_sends_openais_events_in_order(router: cluster.Router, start_worker,
                                                                 tokenizer: Tokenizer) -> None:
    worker = await start_worker()
    await cluster.wait_for_workers(router, 1)

    stream = await router.client.responses.create(model=MODEL_DIR_NAME, input=PROMPT, max_output_tokens=12,
                                                  stream=True)
    events = [event async for event in stream]
    kinds = [event.type for event in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == [*TEXT_EVENTS, *["response.output_text.delta"] * deltas, *TEXT_DONE, "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == await sim_answer(worker, tokenizer, 1)
    assert events[-4].text == text and events[-2].item.content[0].text == text
    completed = events[-1].response
    assert completed.output_text == text and completed.usage.output_tokens == 12
    assert completed.output[0].id == events[2].item.id == events[4].item_id
    assert events[0].response.status == "in_progress" and not events[0].response.output

    async with router.client.responses.stream(model=MODEL_DIR_NAME, input=PROMPT, max_output_tokens=4) as helper:
        final = await helper.get_final_response()
    assert final.output_text == await sim_answer(worker, tokenizer, 2)


async def test_a_streamed_function_call_sends_its_arguments_events(router: cluster.Router, scripted_worker) -> None:
    await scripted_worker(WEATHER_CALL)
    await cluster.wait_for_workers(router, 1)

    stream = await router.client.responses.create(model=MODEL_DIR_NAME, input="Weather in Oslo?",
                                                  tools=[WEATHER_TOOL], max_output_tokens=64, stream=True)
    events = [event async for event in stream]
    assert [event.type for event in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert json.loads(events[4].arguments) == {"city": "Oslo"} and events[4].name == "get_weather"
    assert events[-1].response.output[0].call_id == events[5].item.call_id


# ---- stored ------------------------------------------------------------------------------


async def test_a_stored_response_is_retrieved_and_continued(router: cluster.Router, start_worker,
                                                            tokenizer: Tokenizer) -> None:
    worker = await start_worker()
    await cluster.wait_for_workers(router, 1)

    first = await router.client.responses.create(model=MODEL_DIR_NAME, input="Name a river.",
                                                 instructions="Answer in French.", max_output_tokens=6)
    retrieved = await router.client.responses.retrieve(first.id)
    assert retrieved.model_dump() == first.model_dump()

    second = await router.client.responses.create(model=MODEL_DIR_NAME, input="And a mountain?",
                                                  previous_response_id=first.id, max_output_tokens=4)
    # the instructions are not carried on; the first turn and its answer are
    conversation = [{"role": "user", "content": "Name a river."},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "And a mountain?"}]
    assert worker.requests[-1].token_ids == chat_prompt(tokenizer, conversation)
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.previous_response_id == first.id

    with pytest.raises(openai.BadRequestError) as refused:
        await router.client.responses.cancel(first.id)
    assert refused.value.body["param"] == "response_id" and "synchronous" in refused.value.body["message"]


async def test_store_false_stores_nothing_and_unknown_ids_are_404s(router: cluster.Router, start_worker) -> None:
    await start_worker()
    await cluster.wait_for_workers(router, 1)

    unstored = await router.client.responses.create(model=MODEL_DIR_NAME, input="hi", store=False,
                                                    max_output_tokens=2)
    for call in (router.client.responses.retrieve(unstored.id), router.client.responses.cancel(unstored.id)):
        with pytest.raises(openai.NotFoundError) as missing:
            await call
        assert missing.value.body == {"message": f"Response with id '{unstored.id}' not found.",
                                      "type": "invalid_request_error", "param": "response_id", "code": "not_found"}
    with pytest.raises(openai.NotFoundError) as missing:
        await router.client.responses.create(model=MODEL_DIR_NAME, input="hi", previous_response_id=unstored.id)
    assert missing.value.body["param"] == "previous_response_id"
    assert (await router.http.get("/v1/responses/not..an/id")).status_code == 404


# ---- refused -----------------------------------------------------------------------------


@pytest.mark.parametrize(("extra", "param", "message"), [
    ({"background": True}, "background", "not supported"),
    ({"include": ["message.output_text.logprobs"]}, "include", "not supported"),
    ({"reasoning": {"effort": "low"}}, "reasoning", "no reasoning parser"),
    ({"tools": [{"type": "web_search"}]}, "tools.0", "built-in tool 'web_search'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "takes no images"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]}, "input", "not served"),
    ({"truncation": "middle"}, "truncation", "'auto' or 'disabled'"),
    ({"top_logprobs": 2}, "top_logprobs", "not supported"),
    ({"frobnicate": 1}, "frobnicate", "not a field"),
    ({"max_output_tokens": 0}, "max_output_tokens", "at least 1"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "nope"}}, None, "not among the tools"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "schema is needed"),
])
async def test_a_field_tandem_does_not_honour_is_a_400_naming_it(router: cluster.Router, start_worker, extra,
                                                                 param, message) -> None:
    await start_worker()
    await cluster.wait_for_workers(router, 1)
    body = {"model": MODEL_DIR_NAME, "input": "hi", **extra}
    answer = await router.http.post("/v1/responses", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and message in error["message"], error


async def test_another_router_replica_finds_a_stored_response(router: cluster.Router, bus_config: BusConfig,
                                                               model_dir: str, start_worker,
                                                               tokenizer: Tokenizer) -> None:
    worker = await start_worker()
    await cluster.wait_for_workers(router, 1)
    first = await router.client.responses.create(model=MODEL_DIR_NAME, input="Name a river.", max_output_tokens=3)

    async with cluster.running_router(cluster.router_config(bus_config, model_dir)) as replica:
        await cluster.wait_for_workers(replica, 1)
        assert (await replica.client.responses.retrieve(first.id)).output_text == first.output_text
        await replica.client.responses.create(model=MODEL_DIR_NAME, input="And a mountain?",
                                              previous_response_id=first.id, max_output_tokens=2)
    conversation = [{"role": "user", "content": "Name a river."}, {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "And a mountain?"}]
    assert worker.requests[-1].token_ids == chat_prompt(tokenizer, conversation)


async def test_the_bucket_drops_its_oldest_responses_past_its_bytes(bus: Bus, bus_config: BusConfig) -> None:
    body = ResponsesRequest.model_validate({"input": "hi"})
    stored = [StoredResponse(response=ResponseDraft(body, "m", 1, 8).finished("x" * 1000, [], "stop",
                                                                               usage_of(1, 1, 0)),
                             conversation=[]) for _ in range(4)]
    size = len(stored[0].model_dump_json(by_alias=True))
    settings = ResponsesConfig(max_bytes=3 * size + 600, max_record_bytes=size + 100, ttl_s=60)  # 3 fit, with headers
    store = await JetStreamResponseStore.open(bus, bus_config.subjects, settings)
    for one in stored:
        assert await store.put(one)
    assert await store.get(stored[0].response.id) is None  # dropped for the newer ones
    assert (await store.get(stored[3].response.id)).response == stored[3].response
    big = StoredResponse(response=ResponseDraft(body, "m", 1, 8).finished("x" * 1200, [], "stop", usage_of(1, 1, 0)),
                         conversation=[])
    assert not await store.put(big) and await store.get(big.response.id) is None
    assert await store.get("resp_../etc") is None  # not an id: never looked up
