"""The disaggregated flow in push mode (`pd_transfer="push"`) through the router's HTTP API,
against a real nats-server and real prefill/decode workers (sim engines pushing KV over the
in-memory transport: these tests run without NIXL): decode worker asked first, the same
text as one worker, a failed prefill cancels the waiting decode, a decode worker that
refuses before its `KvTarget` means the prefill worker is never asked, and a pair with a
pull-only engine falls back to pull."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from services.router.config import RoutingConfig
from services.router.routing.config import ALWAYS_SPLIT
from services.worker.engines import engine_spec
from shared.config import BusConfig
from shared.schemas.membership import EngineCapabilities
from shared.tokenizer import Tokenizer
from tests.integration import router_cluster as cluster
from tests.integration.router_cluster import MODEL_DIR_NAME
from tests.waiting import wait_for

PROMPT = "Once upon a time the river ran past the old mill, and the miller sang to the water all day long."


@pytest.fixture
async def router(bus_config: BusConfig, model_dir: str) -> AsyncIterator[cluster.Router]:
    routing = RoutingConfig(kv_aware=ALWAYS_SPLIT, pd_transfer="push")
    config = cluster.router_config(bus_config, model_dir, routing=routing)
    async with cluster.running_router(config) as running:
        yield running


def body(**fields) -> dict:
    return {"model": MODEL_DIR_NAME, "prompt": PROMPT, "max_tokens": 12, **fields}


async def test_push_asks_the_decode_worker_first(router: cluster.Router, start_worker, start_pd,
                                                 tokenizer: Tokenizer) -> None:
    solo = await start_worker("solo")
    await cluster.wait_for_workers(router, 1)
    reference = (await router.http.post("/v1/completions", json=body())).json()
    await solo.stop()
    await cluster.wait_for_workers(router, 0)

    prefill, decode = await start_pd()
    await cluster.wait_for_workers(router, 2)
    whole = (await router.http.post("/v1/completions", json=body())).json()
    assert whole["choices"][0]["text"] == reference["choices"][0]["text"]
    assert whole["choices"][0]["finish_reason"] == "length" and whole["usage"]["completion_tokens"] == 12
    stream = await router.client.completions.create(model=MODEL_DIR_NAME, prompt=PROMPT, max_tokens=12, stream=True)
    streamed = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
    assert streamed == reference["choices"][0]["text"]

    prompt_ids = tokenizer.encode(PROMPT)
    await wait_for(lambda: len(decode.requests) == len(prefill.requests) == 2, cluster.DEADLINE_S, "two of each part")
    waiting, pushing = decode.requests[0], prefill.requests[0]
    assert waiting.token_ids == prompt_ids and waiting.sampling.max_tokens == 11
    assert waiting.kv_transfer is not None and waiting.kv_transfer.await_push and waiting.kv_transfer.source is None
    assert pushing.token_ids == prompt_ids and pushing.sampling.max_tokens == 1
    assert pushing.kv_transfer is not None and pushing.kv_transfer.push_to is not None
    assert pushing.kv_transfer.push_to.reader_worker_id == "d1" and not pushing.kv_transfer.hold_for_decode
    assert prefill.active_leases == 0 and prefill.released() == []  # no lease in push mode

    await cluster.wait_until_idle(router)
    text = await cluster.metrics_text(router)
    assert 'tandem_router_kv_transfer_mode_total{mode="push"} 2.0' in text
    assert "tandem_router_disaggregated_requests_total 2.0" in text


async def test_one_token_answers_keep_the_prefill_only_path(router: cluster.Router, start_pd) -> None:
    prefill, decode = await start_pd()
    await cluster.wait_for_workers(router, 2)
    reply = await router.http.post("/v1/completions", json=body(max_tokens=1))
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 1
    await wait_for(lambda: prefill.requests, cluster.DEADLINE_S, "the prefill request")
    assert decode.requests == [] and prefill.requests[0].kv_transfer is None
    await cluster.wait_until_idle(router)


async def test_a_failed_prefill_cancels_the_waiting_decode(router: cluster.Router, start_pd) -> None:
    prefill, decode = await start_pd(prefill={"fail": "internal", "fail_after": 0})
    await cluster.wait_for_workers(router, 2)
    reply = await router.http.post("/v1/completions", json=body())
    assert reply.status_code == 500, reply.text
    await wait_for(lambda: decode.cancels, cluster.DEADLINE_S, "the decode worker's cancel")
    assert decode.cancels == [decode.requests[0].request_id]
    await cluster.wait_until_idle(router)


async def test_a_decode_worker_refusing_means_no_prefill(router: cluster.Router, start_pd) -> None:
    prefill, decode = await start_pd(decode={"refuse": True})
    await cluster.wait_for_workers(router, 2)
    reply = await router.http.post("/v1/completions", json=body())
    assert reply.status_code == 503, reply.text
    await wait_for(lambda: decode.requests, cluster.DEADLINE_S, "the decode request")
    assert prefill.requests == []  # no target, so nothing to push to
    await cluster.wait_until_idle(router)


PULL_ONLY = EngineCapabilities(kv_pull=True, kv_push=False)


def capabilities_of(engine: str) -> EngineCapabilities:
    return PULL_ONLY if engine == "pull-only" else engine_spec(engine).capabilities


@pytest.mark.parametrize("engines", [("sim", "pull-only"), ("pull-only", "sim")])
async def test_a_pair_with_a_pull_only_worker_falls_back_to_pull(router: cluster.Router, start_pd,
                                                                 engines: tuple[str, str]) -> None:
    # real sim workers; the pull-only one advertises an engine that cannot push
    prefill, decode = await start_pd(prefill={"capabilities": capabilities_of(engines[0])},
                                     decode={"capabilities": capabilities_of(engines[1])})
    await cluster.wait_for_workers(router, 2)
    reply = await router.http.post("/v1/completions", json=body())
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 12
    await wait_for(lambda: prefill.requests and decode.requests, cluster.DEADLINE_S, "both parts")
    first, rest = prefill.requests[0], decode.requests[0]
    assert first.kv_transfer is not None and first.kv_transfer.hold_for_decode and first.kv_transfer.push_to is None
    assert rest.kv_transfer is not None and rest.kv_transfer.source is not None and not rest.kv_transfer.await_push
    await cluster.wait_until_idle(router)
    text = await cluster.metrics_text(router)
    assert 'tandem_router_kv_transfer_mode_total{mode="pull"} 1.0' in text
    assert 'mode="push"' not in text
