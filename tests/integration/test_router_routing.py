"""KV-aware routing through the router's HTTP API, against a real nats-server and real sim
workers, which announce what they cache with KV events (a prompt is cached on a worker by
computing it there first, as another router's request would): prefix affinity, sibling bursts
landing together, the decode-first cache-hit threshold, admission control (429), and two
model versions (compatibility hashes) served at once without ever being paired."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack

import httpx
import openai
import pytest

from services.router.config import RoutingConfig
from services.router.routing.config import ALWAYS_SPLIT
from shared.bus import Bus
from shared.codec import Codec, encode
from shared.config import BusConfig
from shared.request_plane import open_stream
from shared.schemas import Cancel, GenerateRequest, LoadSnapshot, SamplingParams, WorkerRole
from shared.tokenizer import Tokenizer
from tests.integration import router_cluster as cluster
from tests.integration.router_cluster import MODEL_DIR_NAME
from tests.waiting import wait_for


def token_ids(tokenizer: Tokenizer, seed: int, count: int) -> list[int]:
    return [3 + (seed * 131 + index * (17 + seed)) % (tokenizer.vocab_size - 3) for index in range(count)]


async def indexed(router: cluster.Router, worker: cluster.SimWorker, blocks: int) -> None:
    """Wait until the router's KV index holds `blocks` blocks reported by `worker`."""
    await cluster.wait_for_metric(router, f'tandem_router_kv_index_blocks{{kind="held",worker="{worker.worker_id}"}} '
                                  f'{float(blocks)}')


@pytest.fixture
async def make_router(bus_config: BusConfig, model_dir: str) -> AsyncIterator[Callable[..., Awaitable[cluster.Router]]]:
    """Start a router with these routing settings (stopped after the test)."""
    async with AsyncExitStack() as stack:
        async def make(**routing) -> cluster.Router:
            config = cluster.router_config(bus_config, model_dir, routing=RoutingConfig(**routing))
            return await stack.enter_async_context(cluster.running_router(config))

        yield make


# ---- where the prompt is cached -----------------------------------------------------------


async def test_a_prefix_heavy_request_goes_to_the_worker_holding_it(router: cluster.Router, start_worker,
                                                                    tokenizer: Tokenizer) -> None:
    # No load reports: a report sent while the previous turn ran (prefill queued) could still
    # stand when the next turn is routed, and a busy holder may rightly lose to a pull. The
    # router's own in-flight count is the load here, so the choice shows the cache alone.
    first = await start_worker("w1", load_interval_s=600.0)
    holder = await start_worker("w2", load_interval_s=600.0)
    await cluster.wait_for_workers(router, 2)
    prefix = token_ids(tokenizer, 1, 16 * cluster.BLOCK_SIZE)
    await holder.warm(prefix)
    await indexed(router, holder, 16)

    for turn in range(3):  # follow-up turns keep going where the conversation is cached
        reply = await router.client.completions.create(model=MODEL_DIR_NAME, prompt=[*prefix, 5 + turn, 7],
                                                       max_tokens=3)
        assert reply.choices[0].finish_reason == "length"
    await wait_for(lambda: len(holder.requests) == 3, cluster.DEADLINE_S, "three turns at the holder")
    assert not first.requests
    await router.client.completions.create(model=MODEL_DIR_NAME, prompt=token_ids(tokenizer, 2, 40), max_tokens=3)
    await wait_for(lambda: len(first.requests) == 1, cluster.DEADLINE_S, "a cold prompt at w1")  # it goes by load


async def test_a_burst_of_siblings_lands_together_before_any_kv_event(router: cluster.Router, start_worker,
                                                                      tokenizer: Tokenizer) -> None:
    # No KV event and no load report during the burst, however slowly this host serves it:
    # the siblings must follow the first one on the router's own predictions alone. (With
    # events on, a slow host can see the first sibling's blocks reported while its prefill
    # still counts as queued, and rightly pull the prefix to the idle worker; a report can
    # count each waiting sibling's whole prompt.)
    first = await start_worker("w1", hold=True, load_interval_s=600.0, kv_event_interval_s=600.0)
    second = await start_worker("w2", hold=True, load_interval_s=600.0, kv_event_interval_s=600.0)
    await cluster.wait_for_workers(router, 2)
    prefix = token_ids(tokenizer, 3, 64 * cluster.BLOCK_SIZE)  # a long shared system prompt
    siblings = [asyncio.create_task(router.client.completions.create(
        model=MODEL_DIR_NAME, prompt=[*prefix, *token_ids(tokenizer, 10 + i, cluster.BLOCK_SIZE)], max_tokens=2))
        for i in range(4)]
    await wait_for(lambda: len(first.requests) + len(second.requests) == 4, cluster.DEADLINE_S, "four routed siblings")
    assert sorted([len(first.requests), len(second.requests)]) == [0, 4]  # the prefix is computed once
    text = await cluster.metrics_text(router)
    busy = first if first.requests else second
    assert f'tandem_router_kv_index_blocks{{kind="speculative",worker="{busy.worker_id}"}}' in text
    other = asyncio.create_task(router.client.completions.create(
        model=MODEL_DIR_NAME, prompt=token_ids(tokenizer, 4, 40), max_tokens=2))
    await wait_for(lambda: len(first.requests) + len(second.requests) == 5, cluster.DEADLINE_S, "the unrelated request")
    assert len(busy.requests) == 4  # an unrelated prompt goes to the idle worker
    first.release()
    second.release()
    await asyncio.wait_for(asyncio.gather(*siblings, other), cluster.DEADLINE_S)
    await cluster.wait_until_idle(router)


# ---- decode-first: the cache-hit threshold -----------------------------------------------


async def test_below_the_cache_hit_threshold_the_answer_is_cache_threshold(router: cluster.Router, start_worker,
                                                                           tokenizer: Tokenizer) -> None:
    worker = await start_worker("w1")
    await cluster.wait_for_workers(router, 1)
    prompt = token_ids(tokenizer, 5, 5 * cluster.BLOCK_SIZE)
    await worker.warm(prompt[:4 * cluster.BLOCK_SIZE])  # 80% of the prompt
    await indexed(router, worker, 4)

    reply = await router.client.completions.create(model=MODEL_DIR_NAME, prompt=prompt, max_tokens=4,
                                                   extra_body={"cache_hit_threshold": 0.9})
    choice = reply.choices[0]
    assert (choice.text, choice.finish_reason) == ("", "cache_threshold")
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), 0)
    assert reply.usage.prompt_tokens_details.cached_tokens == 4 * cluster.BLOCK_SIZE
    assert not worker.requests  # no worker was asked to generate

    body = {"model": MODEL_DIR_NAME, "prompt": prompt, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}, "cache_hit_threshold": 1}
    async with router.http.stream("POST", "/v1/completions", json=body) as streamed:
        assert streamed.status_code == 200
        events = [line.removeprefix("data: ") async for line in streamed.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) == 3
    chunk, usage = json.loads(events[0]), json.loads(events[1])
    assert chunk["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": "cache_threshold"}]
    assert usage["usage"]["completion_tokens"] == 0 and usage["usage"]["prompt_tokens"] == len(prompt)

    chat = await router.client.chat.completions.create(model=MODEL_DIR_NAME, max_tokens=4,
                                                       messages=[{"role": "user", "content": "cold"}],
                                                       extra_body={"cache_hit_threshold": 0.5})
    assert (chat.choices[0].message.content, chat.choices[0].finish_reason) == ("", "cache_threshold")
    stream = await router.client.chat.completions.create(model=MODEL_DIR_NAME, max_tokens=4, stream=True,
                                                         messages=[{"role": "user", "content": "cold"}],
                                                         extra_body={"cache_hit_threshold": 0.5})
    chunks = [chunk async for chunk in stream]
    assert [c.choices[0].finish_reason for c in chunks] == [None, "cache_threshold"]
    assert not worker.requests

    # warm enough: served as usual, by the worker holding the prefix
    reply = await router.client.completions.create(model=MODEL_DIR_NAME, prompt=prompt, max_tokens=4,
                                                   extra_body={"cache_hit_threshold": 0.8})
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 4
    assert reply.usage.prompt_tokens_details.cached_tokens == 4 * cluster.BLOCK_SIZE  # the worker's own count
    await wait_for(lambda: len(worker.requests) == 1, cluster.DEADLINE_S, "the warm request")

    text = await cluster.metrics_text(router)
    assert 'tandem_router_route_decisions_total{flow="none",reason="cache_threshold"} 4.0' in text
    assert 'tandem_router_route_decisions_total{flow="single",reason="decode_first"} 1.0' in text
    assert 'tandem_router_requests_total{endpoint="completions",outcome="ok"} 3.0' in text


@pytest.mark.parametrize("threshold", [-0.1, 1.5, "0.5"])
async def test_a_cache_hit_threshold_out_of_range_is_a_400(router: cluster.Router, threshold) -> None:
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        response = await router.http.post(path, json={"model": MODEL_DIR_NAME, "cache_hit_threshold": threshold,
                                                      **body})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "cache_hit_threshold"


async def test_the_router_default_threshold_applies_unless_a_request_names_its_own(make_router, start_worker,
                                                                                   tokenizer: Tokenizer) -> None:
    router = await make_router(cache_hit_threshold=0.5)
    worker = await start_worker("w1")
    await cluster.wait_for_workers(router, 1)
    prompt = token_ids(tokenizer, 6, 40)
    reply = await router.client.completions.create(model=MODEL_DIR_NAME, prompt=prompt, max_tokens=2)
    assert reply.choices[0].finish_reason == "cache_threshold" and not worker.requests
    reply = await router.client.completions.create(model=MODEL_DIR_NAME, prompt=prompt, max_tokens=2,
                                                   extra_body={"cache_hit_threshold": 0})
    assert reply.choices[0].finish_reason == "length"
    await wait_for(lambda: len(worker.requests) == 1, cluster.DEADLINE_S, "the request")


# ---- admission control ------------------------------------------------------------------------


async def test_every_worker_past_its_queue_limit_is_a_429_with_retry_after(make_router, start_worker,
                                                                          bus: Bus, tokenizer: Tokenizer) -> None:
    router = await make_router(max_queue_factor=1.0, retry_after_s=3)
    worker = await start_worker("w1", hold=True, max_num_seqs=2)
    await cluster.wait_for_workers(router, 1)
    held = [asyncio.create_task(router.client.completions.create(model=MODEL_DIR_NAME, prompt=f"p{i}",
                                                                 max_tokens=3)) for i in range(2)]
    await wait_for(lambda: len(worker.requests) == 2, cluster.DEADLINE_S, "two requests in flight")

    response = await router.http.post("/v1/completions", json={"model": MODEL_DIR_NAME, "prompt": "one more"})
    assert response.status_code == 429 and response.headers["retry-after"] == "3"
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "overloaded")
    with pytest.raises(openai.RateLimitError):
        await router.client.chat.completions.create(model=MODEL_DIR_NAME, messages=[{"role": "user", "content": "x"}])
    assert len(worker.requests) == 2  # nothing was queued on the worker

    worker.release()
    await asyncio.wait_for(asyncio.gather(*held), cluster.DEADLINE_S)
    await cluster.wait_until_idle(router)
    assert (await router.client.completions.create(model=MODEL_DIR_NAME, prompt="now", max_tokens=1)).choices

    # the worker's own load report counts too: requests of another router keep it busy
    # (its engine slowed down so that they stay running and waiting)
    worker.engine.speedup = 0.5
    subjects = router.config.bus.subjects
    loads: list[LoadSnapshot] = []
    load_codec: Codec[LoadSnapshot] = Codec(LoadSnapshot)

    async def on_load(msg) -> None:
        loads.append(load_codec.decode(msg.data))

    await bus.client.subscribe(subjects.load("w1"), cb=on_load)
    others = [GenerateRequest(request_id=f"other-router-{i}", model=MODEL_DIR_NAME,
                              token_ids=token_ids(tokenizer, 30 + i, 40), sampling=SamplingParams(max_tokens=200))
              for i in range(7)]
    streams = [await open_stream(bus, subjects.generate("w1"), request) for request in others]

    async def overloaded() -> bool:
        try:  # a request admitted before the report arrived would wait on the slow engine
            response = await router.http.post("/v1/completions", timeout=1.0,
                                              json={"model": MODEL_DIR_NAME, "prompt": "x", "max_tokens": 1})
        except httpx.TimeoutException:
            return False
        return response.status_code == 429

    try:
        await wait_for(lambda: any((load.running, load.waiting) == (2, 5) for load in loads), cluster.DEADLINE_S,
                       "the worker to report 2 running, 5 waiting")
        await wait_for(overloaded, cluster.DEADLINE_S, "the load report to count")
    finally:
        worker.engine.speedup = 50.0
        for request, stream in zip(others, streams):
            await bus.client.publish(subjects.control("w1", "cancel"), encode(Cancel(request_id=request.request_id)))
            await stream.close()
    text = await cluster.metrics_text(router)
    assert 'tandem_router_requests_total{endpoint="completions",outcome="overloaded"}' in text
    assert 'tandem_router_route_decisions_total{flow="none",reason="overloaded"}' in text


# ---- model versions ---------------------------------------------------------------------------


@pytest.fixture
async def pd_router(make_router) -> cluster.Router:
    return await make_router(kv_aware=ALWAYS_SPLIT)  # short prompts, disaggregated all the same


async def test_two_model_versions_live_at_once_are_never_paired(pd_router: cluster.Router, start_worker,
                                                                tokenizer: Tokenizer) -> None:
    workers = {(version, role): await start_worker(f"{role.value}-{version}", role=role, model_version=version)
               for version in ("v1", "v2") for role in (WorkerRole.PREFILL, WorkerRole.DECODE)}
    await cluster.wait_for_workers(pd_router, 4)
    prompts = [token_ids(tokenizer, 20 + i, 2 * cluster.BLOCK_SIZE + i) for i in range(8)]
    replies = await asyncio.gather(*(pd_router.client.completions.create(model=MODEL_DIR_NAME, prompt=prompt,
                                                                        max_tokens=5) for prompt in prompts))
    assert all(reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 5
               for reply in replies)
    await wait_for(lambda: sum(len(worker.requests) for worker in workers.values()) == 16, cluster.DEADLINE_S,
                   "both parts of eight requests")
    for version in ("v1", "v2"):
        prefill, decode = workers[(version, WorkerRole.PREFILL)], workers[(version, WorkerRole.DECODE)]
        assert prefill.requests and len(decode.requests) == len(prefill.requests)
        sources = [request.kv_transfer.source for request in decode.requests if request.kv_transfer]
        assert len(sources) == len(decode.requests)
        assert {(source.holder_worker_id, source.compat_hash) for source in sources} == \
            {(prefill.worker_id, prefill.engine.info.compat_hash)}
    await cluster.wait_until_idle(pd_router)
    assert 'reason="pair"} 8.0' in await cluster.metrics_text(pd_router)
