"""The router's OpenAI API over HTTP, against a real nats-server and real sim workers:
completions and chat, streaming and not, stop strings, load spreading, models, health,
metrics, request records, and a clear 4xx for every kind of bad input.

The workers are `WorkerService` + sim engine in this process (see router_cluster.py); the
sim's output is a function of the token history, so every expected text is computed from
the request the worker received."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest
from nats.aio.msg import Msg

from services.router.flows.detokenizer import answer_text
from shared.bus import Bus
from shared.codec import Codec, encode
from shared.config import BusConfig
from shared.schemas import LoadSnapshot, RequestRecord
from shared.tokenizer import Tokenizer
from tests.integration import router_cluster as cluster
from tests.integration.router_cluster import MODEL_DIR_NAME
from tests.waiting import wait_for

PROMPT = "Hello there, tell me about the river that runs past the old mill in the valley."


async def expected_text(worker: cluster.SimWorker, tokenizer: Tokenizer, count: int) -> str:
    """The sim's answer to the latest of `count` requests the worker has received."""
    await wait_for(lambda: len(worker.requests) == count, cluster.DEADLINE_S, f"request {count} at {worker.worker_id}")
    return answer_text(tokenizer, cluster.reference_tokens(worker.requests[-1], tokenizer.vocab_size))


def a_stop_string(text: str) -> str:
    """Three letters from the middle of `text`: a stop string the answer surely contains."""
    index = next(i for i in range(len(text) // 3, len(text) - 3) if text[i:i + 3].isalpha())
    return text[index:index + 3]


# ---- happy paths ---------------------------------------------------------------------


async def test_completions_streaming_and_not(router: cluster.Router, start_worker, tokenizer: Tokenizer) -> None:
    worker = await start_worker()
    await cluster.wait_for_workers(router, 1)

    completion = await router.client.completions.create(model=MODEL_DIR_NAME, prompt=PROMPT, max_tokens=5,
                                                        temperature=0.5, seed=7)
    assert completion.choices[0].text == await expected_text(worker, tokenizer, 1)
    assert completion.choices[0].finish_reason == "length"
    prompt_ids = tokenizer.encode(PROMPT)
    assert len(prompt_ids) >= cluster.BLOCK_SIZE
    assert completion.usage.prompt_tokens == len(prompt_ids)
    assert completion.usage.completion_tokens == 5
    assert completion.usage.total_tokens == len(prompt_ids) + 5
    assert completion.usage.prompt_tokens_details.cached_tokens == 0  # a cold cache
    sent = worker.requests[-1]
    assert sent.token_ids == prompt_ids and sent.model == MODEL_DIR_NAME
    assert (sent.sampling.max_tokens, sent.sampling.temperature, sent.sampling.seed) == (5, 0.5, 7)

    stream = await router.client.completions.create(model=MODEL_DIR_NAME, prompt=prompt_ids, max_tokens=100,
                                                    stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert text == await expected_text(worker, tokenizer, 2)  # detokenized piece by piece, the same text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 100
    assert worker.requests[-1].token_ids == prompt_ids

    again = await router.client.completions.create(model=MODEL_DIR_NAME, prompt=PROMPT, max_tokens=2)
    full_blocks = len(prompt_ids) // cluster.BLOCK_SIZE
    # the worker's prefix cache
    assert again.usage.prompt_tokens_details.cached_tokens == full_blocks * cluster.BLOCK_SIZE


async def test_a_batch_of_prompts_with_n_choices_each_answers_every_choice_in_order(
        router: cluster.Router, start_worker, tokenizer: Tokenizer) -> None:
    worker = await start_worker()
    await cluster.wait_for_workers(router, 1)
    prompts = ["The river runs", "A fox jumps over"]
    batch = await router.client.completions.create(model=MODEL_DIR_NAME, prompt=prompts, n=3, max_tokens=4,
                                                   temperature=0.7, seed=11)
    assert [choice.index for choice in batch.choices] == list(range(6))
    sent = {(tuple(request.token_ids), request.sampling.seed): request for request in worker.requests}
    for choice in batch.choices:
        prompt_ids = tokenizer.encode(prompts[choice.index // 3])
        request = sent[tuple(prompt_ids), 11 + choice.index % 3]  # the i-th choice of a prompt: seed + i
        assert choice.text == answer_text(tokenizer, cluster.reference_tokens(request, tokenizer.vocab_size))
    assert batch.usage.prompt_tokens == sum(len(tokenizer.encode(prompt)) for prompt in prompts)  # each once
    assert batch.usage.completion_tokens == 6 * 4

    stream = await router.client.completions.create(model=MODEL_DIR_NAME, prompt=prompts, n=2, max_tokens=3,
                                                    stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    texts = {index: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == index)
             for index in range(4)}
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: a prompt's choices agree
    finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1, 2, 3] and chunks[-1].usage.completion_tokens == 4 * 3
    chat = await router.client.chat.completions.create(model=MODEL_DIR_NAME, n=2, max_tokens=3,
                                                       messages=[{"role": "user", "content": "Hello"}])
    assert [choice.index for choice in chat.choices] == [0, 1] and chat.usage.completion_tokens == 6


async def test_chat_streaming_and_not(router: cluster.Router, start_worker, tokenizer: Tokenizer) -> None:
    worker = await start_worker()
    await cluster.wait_for_workers(router, 1)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]

    chat = await router.client.chat.completions.create(model=MODEL_DIR_NAME, messages=messages,
                                                       max_completion_tokens=6)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == await expected_text(worker, tokenizer, 1)
    assert chat.usage.completion_tokens == 6
    assert worker.requests[-1].token_ids == tokenizer.encode(tokenizer.apply_chat_template(messages))

    stream = await router.client.chat.completions.create(model=MODEL_DIR_NAME, messages=messages, max_tokens=200,
                                                         stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == await expected_text(worker, tokenizer, 2)
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == len(worker.requests[-1].token_ids)


async def test_a_chat_shows_its_tools_and_past_calls_to_the_template(router: cluster.Router, start_worker,
                                                                        tokenizer: Tokenizer) -> None:
    worker = await start_worker()
    await cluster.wait_for_workers(router, 1)
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call-1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call-1", "content": "Snow, -3 C"}]
    chat = await router.client.chat.completions.create(model=MODEL_DIR_NAME, messages=messages, tools=[TOOL],
                                                       tool_choice="none", max_tokens=4)
    assert chat.choices[0].message.content == await expected_text(worker, tokenizer, 1)
    assert not chat.choices[0].message.tool_calls and chat.choices[0].finish_reason == "length"
    prompt = tokenizer.decode(worker.requests[-1].token_ids)
    assert '{"name": "get_weather", "description": "The weather in a city", "parameters": {"type": "object"' in prompt
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in prompt
    assert "<tool_response>Snow, -3 C</tool_response>" in prompt


async def test_stop_string_truncates_and_cancels_the_worker(router: cluster.Router, start_worker,
                                                          tokenizer: Tokenizer) -> None:
    worker = await start_worker()
    await cluster.wait_for_workers(router, 1)
    whole = await router.client.completions.create(model=MODEL_DIR_NAME, prompt="x", max_tokens=100)
    reply = whole.choices[0].text
    stop = a_stop_string(reply)
    completion = await router.client.completions.create(model=MODEL_DIR_NAME, prompt="x", max_tokens=100,
                                                        stop=[stop, "zzzz"])
    assert completion.choices[0].text == reply[:min(reply.find(s) for s in (stop, "zzzz") if s in reply)]
    assert completion.choices[0].finish_reason == "stop"
    await wait_for(lambda: worker.cancels, cluster.DEADLINE_S, "the router's cancel")
    assert worker.cancels == [worker.requests[-1].request_id]

    messages = [{"role": "user", "content": "go"}]
    whole = await router.client.chat.completions.create(model=MODEL_DIR_NAME, messages=messages)
    reply = whole.choices[0].message.content
    stop = a_stop_string(reply)
    stream = await router.client.chat.completions.create(model=MODEL_DIR_NAME, stream=True, stop=stop,
                                                         messages=messages)
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply[:reply.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_burst_spreads_across_workers(router: cluster.Router, start_worker) -> None:
    first = await start_worker("w1", hold=True)
    second = await start_worker("w2", hold=True)
    await cluster.wait_for_workers(router, 2)
    burst = [asyncio.create_task(router.client.completions.create(model=MODEL_DIR_NAME, prompt=f"p{i}",
                                                                  max_tokens=4))
             for i in range(6)]
    await wait_for(lambda: len(first.requests) + len(second.requests) == 6, cluster.DEADLINE_S, "six routed requests")
    assert (len(first.requests), len(second.requests)) == (3, 3)
    first.release()
    second.release()
    replies = await asyncio.wait_for(asyncio.gather(*burst), cluster.DEADLINE_S)
    assert all(reply.choices[0].finish_reason == "length" for reply in replies)


async def test_models_health_metrics_and_request_records(router: cluster.Router, start_worker, bus: Bus,
                                                         bus_config: BusConfig) -> None:
    records: list[RequestRecord] = []
    codec: Codec[RequestRecord] = Codec(RequestRecord)

    async def on_record(msg: Msg) -> None:
        records.append(codec.decode(msg.data))

    await bus.client.subscribe(bus_config.subjects.request_events, cb=on_record)
    await start_worker("w1", served_model_name="other-model")
    await cluster.wait_for_workers(router, 1)

    models = await router.client.models.list()
    assert sorted(model.id for model in models.data) == sorted([MODEL_DIR_NAME, "other-model"])
    health = (await router.http.get("/health")).json()
    assert health["status"] == "ok" and health["worker_count"] == 1 and health["workers"] == ["w1"]

    reply = await router.client.completions.create(model="other-model", prompt="hi", max_tokens=3)
    assert reply.choices[0].finish_reason == "length"
    await wait_for(lambda: len(records) == 1, cluster.DEADLINE_S, "the request record")
    assert records[0].outcome == "ok" and records[0].worker_id == "w1" and records[0].completion_tokens == 3
    assert records[0].request_id.startswith("cmpl-") and records[0].ttft_s is not None
    assert records[0].flow == "single" and records[0].reason  # the routing decision, for the collector
    queue_s = records[0].queue_s  # its wait in the router before it was routed (the planner's queue time)
    assert queue_s is not None and 0.0 <= queue_s <= records[0].duration_s

    # malformed bus traffic is counted and dropped; the router keeps serving
    await bus.client.publish(bus_config.subjects.load("w1"), b"\x01garbage")
    members = await bus.key_value(bus_config.subjects.members_bucket)
    await members.put("w-bad", b"not msgpack")
    await bus.client.publish(bus_config.subjects.load("w1"), encode(LoadSnapshot(
        worker_id="w1", seq=1, ts=time.time(), running=0, waiting=0, kv_total_blocks=64, kv_used_blocks=0,
        kv_cached_blocks=0, prompt_tokens_total=0, cached_tokens_total=0, generated_tokens_total=0,
        pending_prefill_tokens=0)))

    async def both_counted() -> bool:
        text = await cluster.metrics_text(router)
        return "w-bad" in text and "load.w1" in text

    await wait_for(both_counted, cluster.DEADLINE_S, "the malformed messages in the router's metrics")
    text = await cluster.metrics_text(router)
    assert 'tandem_router_requests_total{endpoint="completions",outcome="ok"} 1.0' in text
    assert 'tandem_router_time_to_first_token_seconds_count{role="both"} 1.0' in text
    assert "tandem_router_workers 1.0" in text
    assert (await router.client.completions.create(model="other-model", prompt="again", max_tokens=2)).usage

    # the response names its trace; a client's traceparent is continued
    client_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    traced = await router.http.post("/v1/completions", json={"model": "other-model", "prompt": "hi", "max_tokens": 2},
                                    headers={"traceparent": f"00-{client_trace}-00f067aa0ba902b7-01"})
    assert traced.status_code == 200 and traced.headers["x-trace-id"] == client_trace
    assert traced.headers["traceresponse"].startswith(f"00-{client_trace}-")
    refused = await router.http.post("/v1/completions", json={"model": "nope", "prompt": "hi"},
                                     headers={"traceparent": f"00-{client_trace}-00f067aa0ba902b7-01"})
    assert refused.status_code == 404 and refused.headers["x-trace-id"] == client_trace  # error answers too


# ---- bad input -----------------------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


BAD_INPUT = [
    ("/v1/completions", b'{"model": "tiny-router", "prompt": ', 400, None, "Invalid JSON"),
    ("/v1/completions", b'[1, 2]', 400, None, "JSON object"),
    ("/v1/completions", {"model": MODEL_DIR_NAME}, 400, "prompt", "Field required"),
    ("/v1/completions", {"prompt": "hi"}, 400, "model", "Field required"),
    ("/v1/completions", {"model": MODEL_DIR_NAME, "prompt": 5}, 400, "prompt", "expected one of str, list[int]"),
    ("/v1/completions", {"model": MODEL_DIR_NAME, "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens", "integer"),
    ("/v1/completions", {"model": MODEL_DIR_NAME, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    ("/v1/completions", {"model": MODEL_DIR_NAME, "prompt": "hi", "max_tokens": 257}, 400, "max_tokens", "at most 256"),
    ("/v1/completions", {"model": MODEL_DIR_NAME, "prompt": "hi", "n": 0}, 400, "n", "greater than or equal to 1"),
    ("/v1/completions", {"model": MODEL_DIR_NAME, "prompt": "hi", "n": 2, "temperature": 0}, 400, None,
     "greedy sampling"),
    ("/v1/completions", {"model": MODEL_DIR_NAME, "prompt": ["a"] * 9, "n": 8}, 400, None, "at most 64 choices"),
    ("/v1/completions", {"model": MODEL_DIR_NAME, "prompt": "hi", "best_of": 2}, 400, "best_of", "no longer"),
    # nothing silently ignored: a field Tandem does not honour, or one nobody defines, is named
    ("/v1/completions", {"model": MODEL_DIR_NAME, "prompt": "hi", "suffix": "x"}, 400, "suffix", "not supported"),
    ("/v1/chat/completions", {"model": MODEL_DIR_NAME, "messages": [{"role": "user", "content": "x"}],
                              "echo": True}, 400, "echo", "not supported"),
    ("/v1/completions", {"model": MODEL_DIR_NAME, "prompt": "hi", "response_format": {"type": "json_object"}},
     400, None, "the sim engine does not model structured"),
    ("/v1/completions", {"model": MODEL_DIR_NAME, "prompt": "hi", "response_format": {"type": "json_schema"}},
     400, "response_format", "json_schema is needed"),
    ("/v1/completions", {"model": MODEL_DIR_NAME, "prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}},
     400, "structured_outputs", "exactly one"),
    ("/v1/completions", {"model": MODEL_DIR_NAME, "prompt": "hi", "frobnicate": 1}, 400, "frobnicate",
     "not a field"),
    ("/v1/completions", {"model": MODEL_DIR_NAME, "prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias",
     "token ids"),
    ("/v1/completions", {"model": MODEL_DIR_NAME, "prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias",
     "100"),
    ("/v1/completions", {"model": MODEL_DIR_NAME, "prompt": "hi", "max_tokens": 2, "min_tokens": 3}, 400,
     "min_tokens", "must not exceed max_tokens"),
    # the sim engine refuses what its token model cannot honour, naming it
    ("/v1/completions", {"model": MODEL_DIR_NAME, "prompt": "hi", "top_k": 5, "logit_bias": {"5": 1}}, 400, None,
     "the sim engine does not model top_k, logit_bias"),
    ("/v1/completions", {"model": MODEL_DIR_NAME, "prompt": "hi", "temperature": 3}, 400, "temperature", "2"),
    ("/v1/completions", {"model": MODEL_DIR_NAME, "prompt": ["a", ""]}, 400, "prompt", "empty"),
    ("/v1/completions", {"model": MODEL_DIR_NAME, "prompt": ""}, 400, "prompt", "empty"),
    ("/v1/completions", {"model": MODEL_DIR_NAME, "prompt": [1, 999999]}, 400, "prompt", "token ids"),
    ("/v1/completions", {"model": MODEL_DIR_NAME, "prompt": "hi", "stream": "yes"}, 400, "stream", "boolean"),
    ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}, 404, "model", "does not exist"),
    ("/v1/completions", {"model": MODEL_DIR_NAME, "prompt": "word " * 40, "max_tokens": 30}, 400, "max_tokens",
     "maximum context length is 48"),
    ("/v1/chat/completions", {"model": MODEL_DIR_NAME, "messages": []}, 400, "messages", "at least 1"),
    ("/v1/chat/completions", {"model": MODEL_DIR_NAME, "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages.0.role", "role"),
    ("/v1/chat/completions", {"model": MODEL_DIR_NAME, "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": -1}, 400, "max_completion_tokens", "at least 1"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model",
     "does not exist"),
    ("/v1/chat/completions", {"model": MODEL_DIR_NAME, "messages": [{"role": "user", "content": "x"}],
                              "logprobs": True}, 400, None, "the sim engine does not model logprobs"),
    ("/v1/chat/completions", {"model": MODEL_DIR_NAME, "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, None, "top_logprobs needs logprobs: true"),
    # tools: auto (the default with tools) needs the router's tool-call format; choices among the tools
    ("/v1/chat/completions", {"model": MODEL_DIR_NAME, "messages": [{"role": "user", "content": "x"}],
                              "tools": [TOOL]}, 400, "tool_choice", "needs a router started with --tool-call-parser"),
    ("/v1/chat/completions", {"model": MODEL_DIR_NAME, "messages": [{"role": "user", "content": "x"}],
                              "tools": []}, 400, None, "tools must not be an empty array"),
    ("/v1/chat/completions", {"model": MODEL_DIR_NAME, "messages": [{"role": "user", "content": "x"}],
                              "tool_choice": "required"}, 400, None, "tool_choice needs tools"),
    ("/v1/chat/completions", {"model": MODEL_DIR_NAME, "messages": [{"role": "user", "content": "x"}],
                              "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     400, None, "tool_choice names 'nope', which is not among the tools"),
    ("/v1/chat/completions", {"model": MODEL_DIR_NAME, "messages": [{"role": "user", "content": "x"}],
                              "tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     400, None, "send structured output or such a tool_choice, not both"),
    ("/v1/chat/completions", {"model": MODEL_DIR_NAME, "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     400, "tools.0.function.parameters", "valid dictionary"),
    ("/v1/completions", {"model": MODEL_DIR_NAME, "prompt": "x", "tools": [TOOL]}, 400, "tools",
     "tool calls are a chat's"),
    # vLLM's truncate_prompt_tokens: at most the context length, -1 at the least
    ("/v1/completions", {"model": MODEL_DIR_NAME, "prompt": "x", "truncate_prompt_tokens": 49}, 400,
     "truncate_prompt_tokens", "truncate_prompt_tokens=49 cannot be greater than max_model_len = 48"),
    ("/v1/chat/completions", {"model": MODEL_DIR_NAME, "messages": [{"role": "user", "content": "x"}],
                              "truncate_prompt_tokens": -2}, 400, "truncate_prompt_tokens", "-1"),
]


async def test_bad_input_gets_a_clear_openai_error(router: cluster.Router, start_worker) -> None:
    await start_worker(max_model_len=48)
    await cluster.wait_for_workers(router, 1)
    failures = []
    for path, body, status, param, fragment in BAD_INPUT:
        if isinstance(body, bytes):
            response = await router.http.post(path, content=body, headers={"content-type": "application/json"})
        else:
            response = await router.http.post(path, json=body)
        error = response.json().get("error", {})
        if (response.status_code != status or set(error) != {"message", "type", "param", "code"}
                or error["param"] != param or fragment not in error["message"]):
            failures.append((path, body, response.status_code, error))
    assert not failures, "\n".join(map(str, failures))


async def test_a_prompt_past_the_context_is_served_cut_to_it_with_truncate_prompt_tokens(
        router: cluster.Router, start_worker) -> None:
    """-1: as many of the prompt's last tokens as the context takes with one output token;
    without it the same prompt is a 400."""
    await start_worker(max_model_len=48)
    await cluster.wait_for_workers(router, 1)
    body = {"model": MODEL_DIR_NAME, "prompt": "word " * 60, "max_tokens": 1}
    refused = await router.http.post("/v1/completions", json=body)
    assert refused.status_code == 400, refused.text
    served = await router.http.post("/v1/completions", json={**body, "truncate_prompt_tokens": -1})
    assert served.status_code == 200, served.text
    assert served.json()["usage"]["prompt_tokens"] == 47


async def test_openai_client_sees_typed_errors(router: cluster.Router, start_worker) -> None:
    await start_worker()
    await cluster.wait_for_workers(router, 1)
    with pytest.raises(openai.NotFoundError) as not_found:
        await router.client.completions.create(model="missing", prompt="hi")
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        await router.client.chat.completions.create(model=MODEL_DIR_NAME, max_tokens=100000,
                                                    messages=[{"role": "user", "content": "hi"}])
