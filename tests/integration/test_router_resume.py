"""Retries and migration through the router's HTTP API, against a real nats-server and real
sim workers, whose output is a function of the token history (as a greedy model's is),
moving KV over the in-memory transport (no NIXL needed): a worker
lost before its first token is replaced; one lost mid-stream is replaced by another that
continues from the prompt plus every token already generated, in the same client stream,
and the client reads exactly what an uninterrupted run gives — single-worker, and
prefill/decode (decode lost: a new pair; prefill lost after its token: the decode worker
alone). Attempts are bounded, and nothing stays in flight."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import openai
import pytest

from services.router.config import RoutingConfig
from services.router.routing.config import ALWAYS_SPLIT
from shared.config import BusConfig
from shared.schemas import WorkerRole
from shared.tokenizer import Tokenizer
from tests.integration import router_cluster as cluster
from tests.integration.router_cluster import MODEL_DIR_NAME
from tests.waiting import wait_for

PROMPT = "Once upon a time the river ran past the old mill, and the miller sang to the water all day long."
MAX_TOKENS = 12


@pytest.fixture
async def router(bus_config: BusConfig, model_dir: str) -> AsyncIterator[cluster.Router]:
    # short prompts disaggregated all the same; a lost worker is noticed at once
    config = cluster.router_config(bus_config, model_dir, routing=RoutingConfig(kv_aware=ALWAYS_SPLIT))
    async with cluster.running_router(config) as running:
        yield running


@pytest.fixture
def start(start_worker):
    """Start a real sim worker (see router_cluster.start_worker for the options)."""
    return start_worker


async def uninterrupted(router: cluster.Router, start) -> tuple[str, openai.types.CompletionUsage]:
    """The reference: the same request on one worker that nobody stops."""
    solo = await start("solo")
    await cluster.wait_for_workers(router, 1)
    reply = await router.client.completions.create(model=MODEL_DIR_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS)
    await solo.stop()
    await cluster.wait_for_workers(router, 0)
    return reply.choices[0].text, reply.usage


async def streamed_text(stream: openai.AsyncStream, read: list[str]) -> tuple[str, list]:
    chunks = [chunk async for chunk in stream]
    text = "".join(read) + "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    return text, chunks


# ---- single-worker flow ------------------------------------------------------------------------


async def test_a_worker_lost_mid_stream_is_resumed_elsewhere_with_the_same_output(
        router: cluster.Router, start, tokenizer: Tokenizer) -> None:
    expected, expected_usage = await uninterrupted(router, start)
    prompt_ids = tokenizer.encode(PROMPT)
    doomed = await start("w1", hold=True, hold_at=4)  # sends 5 tokens, then hangs
    await cluster.wait_for_workers(router, 1)
    stream = await router.client.completions.create(model=MODEL_DIR_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                    stream=True, stream_options={"include_usage": True})
    first = await anext(stream)
    rescuer = await start("w2")
    await cluster.wait_for_workers(router, 2)
    await doomed.lose()  # dies mid-stream
    text, chunks = await streamed_text(stream, [first.choices[0].text])
    await wait_for(lambda: rescuer.requests, cluster.DEADLINE_S, "the resumed request")

    assert text == expected and chunks[-2].choices[0].finish_reason == "length"
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (expected_usage.prompt_tokens, MAX_TOKENS)
    [resumed] = rescuer.requests
    generated = len(resumed.token_ids) - len(prompt_ids)
    assert 1 <= generated <= 5 and resumed.token_ids[:len(prompt_ids)] == prompt_ids
    assert resumed.sampling.max_tokens == MAX_TOKENS - generated
    assert resumed.request_id == f"{doomed.requests[0].request_id}-r1"
    await cluster.wait_until_idle(router)
    assert 'tandem_router_resumes_total{result="resumed",stage="mid_stream"} 1.0' in await cluster.metrics_text(router)


async def test_a_worker_lost_before_its_first_token_is_retried_elsewhere(router: cluster.Router, start) -> None:
    expected, _ = await uninterrupted(router, start)
    doomed = await start("w1", stall=True)  # takes the request, never answers
    rescuer = await start("w2")
    await cluster.wait_for_workers(router, 2)
    reply = asyncio.create_task(router.client.completions.create(model=MODEL_DIR_NAME, prompt=PROMPT,
                                                                 max_tokens=MAX_TOKENS))
    await wait_for(lambda: doomed.requests, cluster.DEADLINE_S, "the doomed worker's request")
    await doomed.lose()
    result = await asyncio.wait_for(reply, cluster.DEADLINE_S)
    await wait_for(lambda: rescuer.requests, cluster.DEADLINE_S, "the retried request")
    assert result.choices[0].text == expected and result.usage.completion_tokens == MAX_TOKENS
    [retried] = rescuer.requests
    assert retried.token_ids == doomed.requests[0].token_ids and retried.sampling.max_tokens == MAX_TOKENS
    await cluster.wait_until_idle(router)
    assert 'tandem_router_resumes_total{result="resumed",stage="before_first_token"} 1.0' in \
        await cluster.metrics_text(router)


async def test_a_retry_before_the_first_token_may_change_model_version(router: cluster.Router, start) -> None:
    """A rolling upgrade: the v1 worker is lost before answering, only v2 is left: the
    request starts over on v2 (nothing of v1's reached the client)."""
    doomed = await start("w1", stall=True, model_version="v1")
    await cluster.wait_for_workers(router, 1)
    reply = asyncio.create_task(router.client.completions.create(model=MODEL_DIR_NAME, prompt=PROMPT,
                                                                 max_tokens=MAX_TOKENS))
    await wait_for(lambda: doomed.requests, cluster.DEADLINE_S, "the doomed worker's request")
    rescuer = await start("w2", model_version="v2")
    await cluster.wait_for_workers(router, 2)
    await doomed.lose()
    result = await asyncio.wait_for(reply, cluster.DEADLINE_S)
    assert result.usage.completion_tokens == MAX_TOKENS and len(rescuer.requests) == 1
    await cluster.wait_until_idle(router)


async def test_a_resume_mid_stream_never_changes_model_version(router: cluster.Router, start) -> None:
    """Lost after its first tokens with only a worker of another version left: the stream
    ends with an explicit error rather than mixing two versions in one answer."""
    doomed = await start("w1", hold=True, hold_at=4, model_version="v1")
    await cluster.wait_for_workers(router, 1)
    stream = await router.client.completions.create(model=MODEL_DIR_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                    stream=True)
    first = await anext(stream)
    assert first.choices[0].text and doomed.requests
    other = await start("w2", model_version="v2")
    await cluster.wait_for_workers(router, 2)
    await doomed.lose()
    with pytest.raises(openai.APIError):
        async for _ in stream:
            pass
    assert not other.requests
    await cluster.wait_until_idle(router)


async def test_attempts_are_bounded(bus_config: BusConfig, model_dir: str, start) -> None:
    config = cluster.router_config(bus_config, model_dir, max_attempts=2)
    async with cluster.running_router(config) as router:
        refusing = [await start(f"w{i}", refuse=True) for i in range(3)]
        await cluster.wait_for_workers(router, 3)
        started = time.monotonic()
        response = await router.http.post("/v1/completions", json={"model": MODEL_DIR_NAME, "prompt": PROMPT})
        assert response.status_code == 503 and time.monotonic() - started < 2.0
        await wait_for(lambda: sum(len(worker.requests) for worker in refusing) == 2, cluster.DEADLINE_S,
                       "two attempts")
        assert 'tandem_router_resumes_total{result="failed",stage="before_first_token"} 1.0' in \
            await cluster.metrics_text(router)


# ---- prefill/decode flow -----------------------------------------------------------------------


async def test_a_decode_worker_lost_mid_stream_is_resumed_on_a_new_pair(router: cluster.Router, start,
                                                                        tokenizer: Tokenizer) -> None:
    expected, _ = await uninterrupted(router, start)
    prefill = await start("p1", role=WorkerRole.PREFILL)
    doomed = await start("d1", role=WorkerRole.DECODE, hold=True, hold_at=2)
    await cluster.wait_for_workers(router, 2)
    stream = await router.client.completions.create(model=MODEL_DIR_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                    stream=True)
    read = [(await anext(stream)).choices[0].text]
    await wait_for(lambda: bool(doomed.requests), cluster.DEADLINE_S, "the decode part")
    rescuer = await start("d2", role=WorkerRole.DECODE)
    await cluster.wait_for_workers(router, 3)
    await doomed.lose()
    text, chunks = await streamed_text(stream, read)
    assert text == expected and chunks[-1].choices[0].finish_reason == "length"
    await wait_for(lambda: len(prefill.requests) == 2 and rescuer.requests, cluster.DEADLINE_S, "the new pair's parts")

    prompt_ids = tokenizer.encode(PROMPT)
    assert len(prefill.requests) == 2  # the continuation was computed by a prefill worker again
    continued = prefill.requests[1]
    assert len(continued.token_ids) > len(prompt_ids) + 1 and continued.sampling.max_tokens == 1
    [rest] = rescuer.requests
    assert rest.token_ids[:len(continued.token_ids)] == continued.token_ids
    assert len(rest.token_ids) - len(prompt_ids) + rest.sampling.max_tokens == MAX_TOKENS
    await wait_for(lambda: prefill.active_leases == 0, cluster.DEADLINE_S, "every lease released")
    await cluster.wait_until_idle(router)


async def test_a_prefill_worker_lost_after_its_token_leaves_the_rest_to_the_decode_worker(
        router: cluster.Router, start, tokenizer: Tokenizer) -> None:
    expected, _ = await uninterrupted(router, start)
    prefill = await start("p1", role=WorkerRole.PREFILL, hold=True)  # its first token, then silence
    decode = await start("d1", role=WorkerRole.DECODE)
    await cluster.wait_for_workers(router, 2)
    stream = await router.client.completions.create(model=MODEL_DIR_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                    stream=True)
    read = [(await anext(stream)).choices[0].text]
    await prefill.lose()
    text, _ = await streamed_text(stream, read)
    assert text == expected
    prompt_ids = tokenizer.encode(PROMPT)
    await wait_for(lambda: decode.requests, cluster.DEADLINE_S, "the decode part")
    [rest] = decode.requests  # no prefill worker left: the decode worker computes the prompt itself
    assert rest.token_ids == [*prompt_ids, *cluster.reference_tokens(prefill.requests[0], tokenizer.vocab_size)]
    assert rest.kv_transfer is None and rest.sampling.max_tokens == MAX_TOKENS - 1
    await cluster.wait_until_idle(router)
