"""The prefill-first disaggregated flow through the router's HTTP API, against a real
nats-server and real prefill/decode workers (sim engines, KV over the in-memory transport:
these tests run without NIXL): the same text as one worker, the first token before the
decode worker is asked, no decode for one-token answers, explicit errors with the lease
released when decode fails or the client leaves, compatibility-hash pairing, metrics, and
one trace across both parts."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator

import httpx
import openai
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.router.config import RoutingConfig
from services.router.routing.config import ALWAYS_SPLIT
from shared.config import BusConfig, KvFaultConfig
from shared.schemas import WorkerRole
from shared.tokenizer import Tokenizer
from tests.integration import router_cluster as cluster
from tests.integration.router_cluster import MODEL_DIR_NAME
from tests.waiting import wait_for

PROMPT = "Once upon a time the river ran past the old mill, and the miller sang to the water all day long."


@pytest.fixture
async def router(bus_config: BusConfig, model_dir: str) -> AsyncIterator[cluster.Router]:
    """Every prompt here is short: disaggregate them all the same (conditional
    disaggregation has tests of its own)."""
    config = cluster.router_config(bus_config, model_dir, routing=RoutingConfig(kv_aware=ALWAYS_SPLIT))
    async with cluster.running_router(config) as running:
        yield running


def body(**fields) -> dict:
    return {"model": MODEL_DIR_NAME, "prompt": PROMPT, "max_tokens": 12, **fields}


async def sse_events(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") async for line in response.aiter_lines() if line.startswith("data: ")]


# ---- the flow ------------------------------------------------------------------------


async def test_disaggregated_output_equals_one_worker(router: cluster.Router, start_worker, start_pd,
                                                      tokenizer: Tokenizer) -> None:
    prompt_ids = tokenizer.encode(PROMPT)
    full_blocks = len(prompt_ids) // cluster.BLOCK_SIZE
    assert full_blocks  # at least one full block: a lease to hand over

    async def answers() -> list[tuple[str, str, int, int]]:
        results = []
        for prompt in (PROMPT, "hi"):  # "hi" has no full block: decode computes everything
            whole = await router.client.completions.create(model=MODEL_DIR_NAME, prompt=prompt, max_tokens=12)
            usage = whole.usage
            results.append((whole.choices[0].text, whole.choices[0].finish_reason, usage.prompt_tokens,
                            usage.completion_tokens))
            stream = await router.client.completions.create(model=MODEL_DIR_NAME, prompt=prompt, max_tokens=12,
                                                            stream=True, stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
            text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
            finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1]
            usage = chunks[-1].usage
            results.append((text, finish, usage.prompt_tokens, usage.completion_tokens))
        return results

    solo = await start_worker("solo")
    await cluster.wait_for_workers(router, 1)
    colocated = await answers()
    await solo.stop()
    await cluster.wait_for_workers(router, 0)

    prefill, decode = await start_pd()
    await cluster.wait_for_workers(router, 2)
    disaggregated = await answers()
    assert disaggregated == colocated
    assert colocated[0][0] and colocated[0][1] == "length"
    assert colocated[0][3] == 12 and colocated[0][2] == len(prompt_ids)

    # what each worker was asked: one token held for decode, then the rest from the handle
    await wait_for(lambda: len(prefill.requests) == len(decode.requests) == 4, cluster.DEADLINE_S, "four of each part")
    first, rest = prefill.requests[0], decode.requests[0]
    assert first.token_ids == prompt_ids and first.sampling.max_tokens == 1
    assert first.kv_transfer is not None and first.kv_transfer.hold_for_decode
    assert rest.token_ids == [*prompt_ids, *cluster.reference_tokens(first, tokenizer.vocab_size)]
    assert rest.sampling.max_tokens == 11 and rest.request_id == first.request_id
    assert rest.kv_transfer is not None and rest.kv_transfer.source is not None
    assert rest.kv_transfer.source.holder_worker_id == prefill.worker_id
    assert decode.requests[2].kv_transfer is None  # "hi": no full block, no handle
    lease_id = rest.kv_transfer.source.lease_id
    await wait_for(lambda: prefill.released(lease_id) == ["done"], cluster.DEADLINE_S, "the decode worker's release")
    assert prefill.active_leases == 0  # the decode worker pulled

    await cluster.wait_until_idle(router)
    text = await cluster.metrics_text(router)
    assert 'tandem_router_route_decisions_total{flow="disaggregated",reason="pair"} 4.0' in text
    assert 'tandem_router_route_decisions_total{flow="single",reason="no_prefill_worker"} 4.0' in text
    assert "tandem_router_disaggregated_requests_total 4.0" in text
    # pulled once: the second time the decode worker finds the prompt's blocks in its own cache
    assert f"tandem_router_kv_pulled_tokens_total {float(cluster.BLOCK_SIZE * full_blocks)}" in text


async def test_the_first_token_reaches_the_client_before_decode_is_asked(router: cluster.Router, start_pd) -> None:
    prefill, decode = await start_pd(prefill={"hold": True})  # holds its Finished back until released
    await cluster.wait_for_workers(router, 2)
    stream = await router.client.completions.create(model=MODEL_DIR_NAME, prompt=PROMPT, max_tokens=6, stream=True)
    first = await asyncio.wait_for(anext(stream), cluster.DEADLINE_S)
    assert first.choices[0].text
    assert not decode.requests  # the client has its first token; the decode worker has not been asked
    prefill.release()
    rest = [chunk async for chunk in stream]
    assert rest[-1].choices[0].finish_reason == "length"
    assert len(decode.requests) == 1


async def test_one_token_answers_never_contact_the_decode_worker(router: cluster.Router, start_pd,
                                                                 tokenizer: Tokenizer) -> None:
    prefill, decode = await start_pd()
    await cluster.wait_for_workers(router, 2)
    reply = await router.client.completions.create(model=MODEL_DIR_NAME, prompt=PROMPT, max_tokens=1)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 1
    await wait_for(lambda: len(prefill.requests) == 1, cluster.DEADLINE_S, "the prefill request")
    assert prefill.requests[-1].kv_transfer is None  # nothing to hold: no lease at all

    # the first token is a stop token: the request ends with the prefill, its lease is released
    [first_token] = cluster.reference_tokens(prefill.requests[-1], tokenizer.vocab_size)
    reply = await router.client.completions.create(model=MODEL_DIR_NAME, prompt=PROMPT, max_tokens=8,
                                                   extra_body={"stop_token_ids": [first_token]})
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens == 1
    assert not decode.requests
    await wait_for(lambda: prefill.released() == ["cancelled"], cluster.DEADLINE_S, "the router's lease release")
    assert prefill.active_leases == 0
    await cluster.wait_until_idle(router)


async def test_a_burst_spreads_over_prefill_and_decode_workers(router: cluster.Router, start_pd) -> None:
    prefill_1, decode_1 = await start_pd(prefill={"hold": True})
    prefill_2, decode_2 = await start_pd(prefill={"worker_id": "p2", "hold": True}, decode={"worker_id": "d2"})
    await cluster.wait_for_workers(router, 4)
    # distinct prompts (no shared block): nothing to gain from landing together
    burst = [asyncio.create_task(router.client.completions.create(model=MODEL_DIR_NAME, prompt=f"{i} {PROMPT}",
                                                                  max_tokens=3)) for i in range(4)]
    await wait_for(lambda: len(prefill_1.requests) + len(prefill_2.requests) == 4, cluster.DEADLINE_S,
                   "four prefill requests")
    assert (len(prefill_1.requests), len(prefill_2.requests)) == (2, 2)
    # each request holds a slot on its prefill and its decode worker, and counts once
    assert (await router.http.get("/health")).json()["in_flight"] == 4
    prefill_1.release()
    prefill_2.release()
    replies = await asyncio.wait_for(asyncio.gather(*burst), cluster.DEADLINE_S)
    assert all(reply.choices[0].finish_reason == "length" for reply in replies)
    assert (len(decode_1.requests), len(decode_2.requests)) == (2, 2)
    await cluster.wait_until_idle(router)


# ---- failures ------------------------------------------------------------------------


@pytest.mark.parametrize("broken", [{"refuse": True}, {"listening": False}, {"fail": "internal", "fail_after": 1}],
                         ids=["refusing", "dead", "failing"])
async def test_decode_failure_is_an_explicit_error_and_the_lease_is_released(router: cluster.Router, start_pd,
                                                                             broken: dict) -> None:
    prefill, decode = await start_pd(decode=broken)
    await cluster.wait_for_workers(router, 2)

    whole = await router.http.post("/v1/completions", json=body())
    expected_status = 500 if "fail" in broken else 503
    assert whole.status_code == expected_status, whole.text
    async with router.http.stream("POST", "/v1/completions", json=body(stream=True)) as streamed:
        assert streamed.status_code == 200  # the first token came from the prefill worker
        events = await sse_events(streamed)
    assert json.loads(events[0])["choices"][0]["text"]
    assert "error" in json.loads(events[-1]) and "[DONE]" not in events

    # The router releases every lease whose decode request did not finish, at once
    # ("cancelled"); a decode worker that pulled released it first ("done").
    await wait_for(lambda: prefill.released().count("cancelled") == 2, cluster.DEADLINE_S,
                   "the router's lease releases")
    await wait_for(lambda: prefill.active_leases == 0, cluster.DEADLINE_S, "no lease left")
    leases = {release.lease_id for release in prefill.recorder.lease_releases}
    assert len(leases) == 2
    if "fail" in broken:
        assert all(prefill.released(lease_id) == ["done", "cancelled"] for lease_id in leases)
    await cluster.wait_until_idle(router)
    result = "already_ended" if "fail" in broken else "released"
    await cluster.wait_for_metric(router, f'tandem_router_kv_lease_releases_total{{result="{result}"}} 2.0')


async def test_client_disconnect_cancels_decode_and_releases_the_lease(router: cluster.Router, start_pd) -> None:
    # decode asked but not yet accepted (a worker gone silent): the router alone must release the lease
    prefill, decode = await start_pd(decode={"silent": True})
    await cluster.wait_for_workers(router, 2)
    async with router.http.stream("POST", "/v1/completions", json=body(stream=True)) as streamed:
        async for line in streamed.aiter_lines():
            if line.startswith("data: "):
                break  # the first token, then hang up once the decode worker has the request
        await wait_for(lambda: decode.requests, cluster.DEADLINE_S, "the decode request")
    await wait_for(lambda: decode.cancels, cluster.DEADLINE_S, "the decode worker's cancel")
    assert decode.cancels == [decode.requests[0].request_id]
    await wait_for(lambda: prefill.released() == ["cancelled"], cluster.DEADLINE_S, "the router's lease release")
    await wait_for(lambda: prefill.active_leases == 0, cluster.DEADLINE_S, "no lease left")
    await cluster.wait_until_idle(router)


async def test_client_disconnect_while_pulling_cancels_decode_and_releases_the_lease(router: cluster.Router,
                                                                                    start_pd) -> None:
    # decode accepted, its pull slowed down: the client leaves; no lease and no block stays behind
    prefill, decode = await start_pd(decode={"kv_faults": KvFaultConfig(delay_s=3.0)})
    await cluster.wait_for_workers(router, 2)
    async with router.http.stream("POST", "/v1/completions", json=body(stream=True)) as streamed:
        async for line in streamed.aiter_lines():
            if line.startswith("data: "):
                break
        await wait_for(lambda: decode.requests, cluster.DEADLINE_S, "the decode request")
    await wait_for(lambda: decode.cancels == [decode.requests[0].request_id], cluster.DEADLINE_S, "the decode cancel")
    await wait_for(lambda: "cancelled" in prefill.released() and prefill.active_leases == 0, cluster.DEADLINE_S,
                   "the lease released")
    assert "done" not in prefill.released()
    await cluster.wait_until_idle(router)


async def test_client_disconnect_while_decoding_cancels_decode(router: cluster.Router, start_pd) -> None:
    prefill, decode = await start_pd(decode={"hold": True})
    await cluster.wait_for_workers(router, 2)
    async with router.http.stream("POST", "/v1/completions", json=body(stream=True)) as streamed:
        seen = 0
        async for line in streamed.aiter_lines():
            seen += line.startswith("data: ")
            if seen == 2:
                break  # one token from each worker, then hang up
    await wait_for(lambda: decode.cancels, cluster.DEADLINE_S, "the decode worker's cancel")
    assert decode.cancels == [decode.requests[0].request_id]
    assert not prefill.cancels  # its part was over
    await wait_for(lambda: "done" in prefill.released(), cluster.DEADLINE_S, "the decode worker's release")
    assert prefill.active_leases == 0
    await cluster.wait_until_idle(router)


async def test_a_decode_worker_removed_mid_stream_with_none_to_resume_is_an_error(router: cluster.Router,
                                                                                  start_pd) -> None:
    prefill, decode = await start_pd(decode={"hold": True})
    await cluster.wait_for_workers(router, 2)
    stream = await router.client.completions.create(model=MODEL_DIR_NAME, prompt=PROMPT, max_tokens=20,
                                                    stream=True)
    await anext(stream)
    await anext(stream)  # the decode worker's first token
    await decode.lose()
    with pytest.raises(openai.APIError) as failure:  # the prefill worker alone cannot decode
        async for _ in stream:
            pass
    assert "left the cluster" in failure.value.message
    await cluster.wait_until_idle(router)


async def test_mixed_compat_hashes_are_never_paired(router: cluster.Router, start_worker, start_pd) -> None:
    prefill, decode = await start_pd(prefill={"model_version": "v1"}, decode={"model_version": "v2"})
    assert prefill.engine.info.compat_hash != decode.engine.info.compat_hash
    await cluster.wait_for_workers(router, 2)
    reply = await router.client.completions.create(model=MODEL_DIR_NAME, prompt=PROMPT, max_tokens=4)
    assert reply.choices[0].finish_reason == "length"
    await wait_for(lambda: decode.requests, cluster.DEADLINE_S, "the request")
    assert not prefill.requests  # served whole by the decode worker
    assert decode.requests[-1].kv_transfer is None and decode.requests[-1].sampling.max_tokens == 4
    assert 'reason="compat_hash_mismatch"} 1.0' in await cluster.metrics_text(router)

    same_hash = await start_worker("d2", role=WorkerRole.DECODE, model_version="v1")
    await cluster.wait_for_workers(router, 3)
    await router.client.completions.create(model=MODEL_DIR_NAME, prompt=PROMPT, max_tokens=4)
    await wait_for(lambda: len(same_hash.requests) == 1, cluster.DEADLINE_S, "the decode part on d2")
    assert len(prefill.requests) == 1 and len(decode.requests) == 1


# ---- observability -------------------------------------------------------------------


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):  # nothing installed one in this process yet
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.shutdown()  # the processor stays; it exports nothing any more


async def test_one_trace_across_both_parts_and_counters(router: cluster.Router, start_pd, spans: InMemorySpanExporter,
                                                        tokenizer: Tokenizer) -> None:
    # the decode worker's transfer breaks before the last block: that block is recomputed
    full_blocks = len(tokenizer.encode(PROMPT)) // cluster.BLOCK_SIZE
    prefill, decode = await start_pd(decode={"kv_faults": KvFaultConfig(cut_after_blocks=full_blocks - 1)})
    await cluster.wait_for_workers(router, 2)
    await router.client.completions.create(model=MODEL_DIR_NAME, prompt=PROMPT, max_tokens=5)
    await cluster.wait_until_idle(router)

    by_name = {span.name: span for span in spans.get_finished_spans() if span.name.startswith("router.")}
    assert sorted(by_name) == ["router.decode", "router.generate", "router.prefill", "router.route"]
    root, prefill_span, decode_span = by_name["router.generate"], by_name["router.prefill"], by_name["router.decode"]
    route = by_name["router.route"]
    assert route.parent is not None and route.parent.span_id == root.context.span_id
    assert route.attributes["tandem.flow"] == "disaggregated" and route.attributes["tandem.route_candidates"] == 2
    assert root.attributes["tandem.flow"] == "disaggregated" and root.attributes["tandem.route_reason"] == "pair"
    assert root.attributes["tandem.prefill_worker_id"] == "p1" and root.attributes["tandem.worker_id"] == "d1"
    for part, worker in ((prefill_span, prefill), (decode_span, decode)):
        assert part.parent is not None and part.parent.span_id == root.context.span_id
        assert part.attributes["tandem.outcome"] == "ok"
        _, trace_id, span_id, _ = worker.headers[0]["traceparent"].split("-")
        assert (int(trace_id, 16), int(span_id, 16)) == (root.context.trace_id, part.context.span_id)
    pulled = cluster.BLOCK_SIZE * (full_blocks - 1)
    assert root.attributes["tandem.pulled_tokens"] == pulled
    assert root.attributes["tandem.recomputed_tokens"] == cluster.BLOCK_SIZE

    text = await cluster.metrics_text(router)
    assert f"tandem_router_kv_pulled_tokens_total {float(pulled)}" in text
    assert f"tandem_router_kv_recomputed_tokens_total {float(cluster.BLOCK_SIZE)}" in text
