"""The whole stack (router, orchestrator, metrics, 2 sim workers as processes) through
the official openai client: completions and chat, streaming and not, concurrency,
determinism, dynamic membership and a worker killed mid-request."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import openai
import pytest

from launch.plan import WorkerSpec
from launch.stack import LocalStack
from shared.bus import Bus
from shared.request_plane import open_stream
from shared.schemas import GenerateRequest, RequestRecord, SamplingParams
from shared.subjects import Subjects
from shared.tokenizer import Tokenizer
from tests.stack_fixtures import collect, records_arrived
from tests.waiting import wait_for

pytestmark = pytest.mark.e2e


def model_name(stack: LocalStack) -> str:
    return Tokenizer.from_model_dir(stack.config.model_dir).model_name


async def test_completion_and_chat_streaming_and_not(stack: LocalStack, client: openai.AsyncOpenAI, loads) -> None:
    model = model_name(stack)
    models = await client.models.list()
    assert model in [m.id for m in models.data]

    completion = await client.completions.create(model=model, prompt="The river runs", max_tokens=12)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 12
    assert completion.choices[0].text

    chunks = [chunk async for chunk in await client.completions.create(
        model=model, prompt="The river runs", max_tokens=12, stream=True)]
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == completion.choices[0].text  # greedy: same tokens either way

    messages = [{"role": "user", "content": "Tell me about machines."}]
    chat = await client.chat.completions.create(model=model, messages=messages, max_tokens=10)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content
    assert chat.usage.completion_tokens == 10

    stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=10, stream=True,
                                                  stream_options={"include_usage": True})
    pieces, usage = [], None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == chat.choices[0].message.content
    assert usage is not None and usage.completion_tokens == 10


async def test_continuous_usage_stats_put_each_choices_usage_so_far_in_every_chunk(
        stack: LocalStack, client: openai.AsyncOpenAI, loads) -> None:
    """vLLM's `stream_options.continuous_usage_stats`, two choices: each chunk counts the prompt
    and its own choice's tokens so far (the role chunk none), the last chunk the whole request."""
    model = model_name(stack)
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count with me."}], max_tokens=9, n=2, temperature=1.0,
        seed=5, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True})
    chunks = [chunk async for chunk in stream]
    counts: dict[int, list[int]] = {}
    for chunk in chunks[:-1]:
        assert chunk.usage is not None and chunk.usage.total_tokens == chunk.usage.prompt_tokens + \
            chunk.usage.completion_tokens
        counts.setdefault(chunk.choices[0].index, []).append(chunk.usage.completion_tokens)
    final = chunks[-1]
    assert not final.choices and final.usage is not None and final.usage.completion_tokens == 18
    assert {chunk.usage.prompt_tokens for chunk in chunks} == {final.usage.prompt_tokens}
    for own in counts.values():  # each text chunk brings at least one token; the last one ends at 9
        texts = own[1:-1]
        assert own[0] == 0 and texts[0] > 0 and texts == sorted(set(texts)) and own[-1] == 9 >= texts[-1], counts

    plain = [chunk async for chunk in await client.completions.create(  # without include_usage: no usage at all
        model=model, prompt="The river runs", max_tokens=4, stream=True,
        stream_options={"include_usage": False, "continuous_usage_stats": True})]
    assert plain and all(chunk.usage is None for chunk in plain)


INCOMPLETE = "\ufffd"  # the text of a last token that ends inside a character: never shown, as by vLLM


async def test_return_token_ids_gives_the_prompts_and_the_answers_tokens(stack: LocalStack,
                                                                          client: openai.AsyncOpenAI) -> None:
    """vLLM's `return_token_ids`: whole, the prompt's ids (completions: per choice; chat: beside
    the choices) and each choice's generated ids, as many as the usage counts, whose text is
    the answer's; streamed, the prompt's ids in the first chunk and every chunk's own ids,
    which add up to the whole answer's (greedy: the same tokens)."""
    model = model_name(stack)
    tokenizer = Tokenizer.from_model_dir(stack.config.model_dir)
    prompt = tokenizer.encode("The river runs")
    extra = {"return_token_ids": True}
    whole = await client.completions.create(model=model, prompt=prompt, max_tokens=8, extra_body=extra)
    choice = whole.choices[0]
    assert choice.prompt_token_ids == prompt
    assert len(choice.token_ids) == whole.usage.completion_tokens == 8
    assert tokenizer.decode(choice.token_ids).rstrip(INCOMPLETE) == choice.text
    chunks = [c async for c in await client.completions.create(model=model, prompt=prompt, max_tokens=8, stream=True,
                                                               extra_body=extra)]
    assert chunks[0].choices[0].prompt_token_ids == prompt
    assert not any(getattr(c.choices[0], "prompt_token_ids", None) for c in chunks[1:])
    assert [t for c in chunks for t in c.choices[0].token_ids] == choice.token_ids
    stopped = await client.completions.create(model=model, prompt=prompt, max_tokens=8, extra_body=extra,
                                              stop=[tokenizer.decode(choice.token_ids[2:4])])
    assert len(stopped.choices[0].token_ids) == stopped.usage.completion_tokens < 8  # up to the stop's last token

    messages = [{"role": "user", "content": "Tell me about machines."}]
    chat = await client.chat.completions.create(model=model, messages=messages, max_tokens=6, extra_body=extra)
    assert len(chat.prompt_token_ids) == chat.usage.prompt_tokens
    assert len(chat.choices[0].token_ids) == chat.usage.completion_tokens == 6
    assert tokenizer.decode(chat.choices[0].token_ids).rstrip(INCOMPLETE) == chat.choices[0].message.content
    chunks = [c async for c in await client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                                                    stream=True, extra_body=extra)]
    assert chunks[0].prompt_token_ids == chat.prompt_token_ids and chunks[0].choices[0].delta.role == "assistant"
    assert [t for c in chunks[1:] for t in c.choices[0].token_ids] == chat.choices[0].token_ids
    plain = await client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    assert "token_ids" not in plain.model_dump(exclude_unset=True)["choices"][0]  # not asked: not there


async def test_truncate_prompt_tokens_serves_the_prompts_last_tokens(stack: LocalStack,
                                                                       client: openai.AsyncOpenAI) -> None:
    """vLLM's `truncate_prompt_tokens`: the prompt served (its ids, its usage) is the request's
    last tokens, or its first with `truncation_side` "right"; -1 leaves a short prompt whole;
    more than the context is a 400 naming the field."""
    model = model_name(stack)
    prompt = Tokenizer.from_model_dir(stack.config.model_dir).encode("The river runs under the old stone bridge")
    assert len(prompt) > 5

    async def served(**fields) -> list[int]:
        answer = await client.completions.create(model=model, prompt=prompt, max_tokens=2,
                                                 extra_body={"return_token_ids": True, **fields})
        assert answer.usage.prompt_tokens == len(answer.choices[0].prompt_token_ids)
        return answer.choices[0].prompt_token_ids

    assert await served(truncate_prompt_tokens=5) == prompt[-5:]
    assert await served(truncate_prompt_tokens=5, truncation_side="right") == prompt[:5]
    assert await served(truncate_prompt_tokens=-1) == prompt
    chat = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Tell me more."}],
                                                max_tokens=2, extra_body={"truncate_prompt_tokens": 3})
    assert chat.usage.prompt_tokens == 3
    response = await client.responses.create(model=model, input="Tell me more.", truncation="auto",
                                             max_output_tokens=2)
    assert response.truncation == "auto" and response.status == "incomplete"
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens=.* cannot be greater than max_model_len"):
        await served(truncate_prompt_tokens=10**9)


async def test_a_chat_renders_as_its_template_fields_ask_as_tokenize_renders_it(
        stack: LocalStack, client: openai.AsyncOpenAI) -> None:
    """add_generation_prompt, continue_final_message and chat_template_kwargs reach the chat
    endpoint's prompt as they reach /tokenize's: the same prompt tokens either way, and each
    field changes the prompt as asked (no assistant opening; the last message left open)."""
    model = model_name(stack)
    messages = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon"}]
    counts = []
    async with httpx.AsyncClient(base_url=stack.router_url, headers={"authorization": f"Bearer {client.api_key}"}) \
            as http:
        for fields in ({}, {"add_generation_prompt": False},
                       {"add_generation_prompt": False, "continue_final_message": True},
                       {"chat_template_kwargs": {"enable_thinking": False}}):
            chat = await client.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                                        extra_body=fields)
            tokenized = (await http.post("/tokenize", json={"model": model, "messages": messages, **fields})).json()
            assert chat.usage.prompt_tokens == tokenized["count"], (fields, tokenized)
            counts.append(tokenized["count"])
    plain, unprompted, open_message, with_kwargs = counts
    assert plain > unprompted > open_message and with_kwargs == plain


async def test_100_concurrent_streams_complete_with_expected_tokens(stack: LocalStack, client: openai.AsyncOpenAI,
                                                                    loads) -> None:
    model = model_name(stack)
    prompts = [f"Prompt number {i} about weather and cooking" for i in range(10)]
    expected = {}
    for prompt in prompts:
        reply = await client.completions.create(model=model, prompt=prompt, max_tokens=20)
        expected[prompt] = reply.choices[0].text

    async def stream_one(prompt: str) -> str:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=20, stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    jobs = [prompts[i % len(prompts)] for i in range(100)]
    results = await asyncio.wait_for(asyncio.gather(*(stream_one(p) for p in jobs)), 120)
    mismatches = [(p, r) for p, r in zip(jobs, results) if r != expected[p]]
    assert not mismatches, f"{len(mismatches)} of 100 streams differ, e.g. {mismatches[:2]}"


async def test_same_request_gives_same_tokens_on_every_worker(stack: LocalStack, stack_bus: Bus, loads) -> None:
    tokenizer = Tokenizer.from_model_dir(stack.config.model_dir)
    subjects = Subjects(stack.config.namespace)
    prompt = tokenizer.encode("Determinism matters for disaggregated serving. " * 5)
    outputs = {}
    for spec in stack.config.workers:
        request = GenerateRequest(request_id=f"det-{spec.worker_id}", model=tokenizer.model_name,
                                  token_ids=prompt, sampling=SamplingParams(max_tokens=24))
        stream = await open_stream(stack_bus, subjects.generate(spec.worker_id), request)
        outputs[spec.worker_id] = [t for frame in [f async for f in stream.frames()] for t in frame.token_ids]
        await stream.close()
    assert len(set(map(tuple, outputs.values()))) == 1, outputs
    assert len(next(iter(outputs.values()))) == 24


async def _records(bus: Bus, stack: LocalStack) -> list[RequestRecord]:
    return await collect(bus, RequestRecord, Subjects(stack.config.namespace).request_events)


async def test_late_worker_receives_traffic_within_2s(stack: LocalStack, client: openai.AsyncOpenAI,
                                                      stack_bus: Bus, loads) -> None:
    model = model_name(stack)
    records = await _records(stack_bus, stack)
    stack.start_worker(WorkerSpec(worker_id="w-late"))
    await asyncio.to_thread(stack.wait_worker_ready, "w-late")

    async def served_by_late() -> bool:  # a burst of requests, then: has w-late served one yet?
        await asyncio.gather(*(client.completions.create(model=model, prompt=f"late {i}", max_tokens=4)
                               for i in range(6)))
        return any(r.worker_id == "w-late" for r in records)

    await wait_for(served_by_late, 2.0, lambda: f"w-late to get a request: {[r.worker_id for r in records]}",
                   interval_s=0.05)
    await asyncio.to_thread(stack.launcher.stop, "w-late")


async def test_sigkilled_worker_loses_no_greedy_request_and_is_avoided(
        stack: LocalStack, client: openai.AsyncOpenAI, stack_bus: Bus, loads) -> None:
    """A worker killed mid-decode under load: its streams resume on other workers from the
    tokens already sent, and every answer equals an uninterrupted run; it leaves the
    cluster within its TTL and new requests avoid it."""
    from tests.e2e.test_disaggregated import as_router_text, reference

    tokenizer = Tokenizer.from_model_dir(stack.config.model_dir)
    model = tokenizer.model_name
    records = await _records(stack_bus, stack)
    stack.start_worker(WorkerSpec(worker_id="w-victim"))
    await asyncio.to_thread(stack.wait_worker_ready, "w-victim")
    prompts = [[3 + (i * 37 + n) % 500 for i in range(40)] for n in range(6)]
    expected = await reference(tokenizer, prompts, 300)

    async def long_stream(prompt: list[int]) -> str:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=300, temperature=0,
                                                 stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    tasks = [asyncio.create_task(long_stream(prompt)) for prompt in prompts]

    def victim_decoding() -> bool:
        snapshot = loads.latest.get("w-victim")
        return snapshot is not None and snapshot.running > 0 and snapshot.generated_tokens_total > 20

    await wait_for(victim_decoding, 10, lambda: f"the victim to decode: {loads.latest.get('w-victim')}")
    killed_at = time.monotonic()
    stack.worker("w-victim").popen.send_signal(signal.SIGKILL)
    texts = await asyncio.wait_for(asyncio.gather(*tasks), 60)  # nothing hangs, nothing fails
    for prompt, text, tokens in zip(prompts, texts, expected):
        assert text == as_router_text(tokenizer, prompt, tokens), "a resumed answer differs"
    async with httpx.AsyncClient() as http:
        async def victim_gone() -> bool:
            return "w-victim" not in (await http.get(f"{stack.router_url}/health")).json()["workers"]

        await wait_for(victim_gone, stack.config.ttl_s + 2.0 - (time.monotonic() - killed_at),
                       "the router to drop the dead worker within its TTL", interval_s=0.05)
        router_metrics = (await http.get(f"{stack.router_url}/metrics")).text
    resumed = [line for line in router_metrics.splitlines()
               if line.startswith("tandem_router_resumes_total{") and 'stage="mid_stream"' in line
               and 'result="resumed"' in line]
    assert resumed and float(resumed[0].rsplit(" ", 1)[1]) >= 1, "no stream was resumed mid-way"
    before = len(records)
    replies = await asyncio.gather(*(client.completions.create(model=model, prompt=f"after {i}", max_tokens=4)
                                     for i in range(8)))
    assert all(r.choices[0].finish_reason == "length" for r in replies)
    await records_arrived(records, before + len(replies))  # the router's record of each: where it went
    assert all(r.worker_id != "w-victim" for r in records[before:])
    stack.launcher.processes.pop("w-victim")
