"""The router when things go wrong: no worker, workers refusing or leaving mid-stream,
worker failures before and after the first byte, clients hanging up, NATS restarting.
Every case ends in an explicit outcome, quickly, with nothing left in flight. The workers
are real (`WorkerService` + sim engine, see router_cluster.py); a dead or refusing member
and an engine failing on cue come from router_fakes.py."""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import httpx
import openai
import pytest

from services.router.main import RouterServer
from shared.bus import connect
from shared.config import BusConfig, MembershipConfig
from shared.nats_server import EmbeddedNats
from shared.tokenizer import Tokenizer
from tests.integration.router_cluster import (
    DEADLINE_S,
    MODEL_DIR_NAME,
    Router,
    check_idle,
    launch_worker,
    router_config,
    wait_for_workers,
    wait_until_idle,
    worker_config,
)
from tests.waiting import wait_for

# ---- failures ------------------------------------------------------------------------


async def test_no_worker_is_503_within_worker_wait(router: Router) -> None:
    started = time.monotonic()
    response = await router.http.post("/v1/completions", json={"model": MODEL_DIR_NAME, "prompt": "hi"})
    elapsed = time.monotonic() - started
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "unavailable"
    assert router.config.worker_wait_s <= elapsed < router.config.worker_wait_s + 1.0


async def test_a_worker_that_appears_while_waiting_serves_the_request(bus_config: BusConfig, model_dir: str,
                                                                       start_worker) -> None:
    server = RouterServer(router_config(bus_config, model_dir, worker_wait_s=10.0))
    task = asyncio.create_task(server.serve())
    await asyncio.wait_for(server.listening.wait(), DEADLINE_S)
    # a draining worker is there first (a real one re-registers as ACTIVE before it drains:
    # started after the request, the router could pick it in that moment)
    draining = await start_worker("w1", draining=True)
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as http:
        pending = asyncio.create_task(http.post("/v1/completions", json={"model": MODEL_DIR_NAME, "prompt": "hi",
                                                                         "max_tokens": 2}))
        await start_worker("w2")
        response = await asyncio.wait_for(pending, DEADLINE_S)
    server.should_exit = True
    await asyncio.wait_for(task, 10)
    assert response.status_code == 200, response.text
    assert not draining.requests


async def test_requests_refused_by_a_worker_are_rerouted(router: Router, start_worker) -> None:
    await start_worker("w1-dead", listening=False)
    refusing = await start_worker("w2-refusing", refuse=True)
    live = await start_worker("w3-live")
    await wait_for_workers(router, 3)
    replies = await asyncio.gather(*(router.client.completions.create(model=MODEL_DIR_NAME, prompt=f"p{i}",
                                                                      max_tokens=2) for i in range(4)))
    assert [reply.choices[0].finish_reason for reply in replies] == ["length"] * 4
    assert len(live.requests) == 4 and refusing.requests


async def test_worker_removed_mid_stream_ends_the_stream_with_an_error(router: Router, start_worker) -> None:
    worker = await start_worker(hold=True)
    await wait_for_workers(router, 1)
    stream = await router.client.completions.create(model=MODEL_DIR_NAME, prompt="hi", max_tokens=50, stream=True)
    first = await anext(stream)
    assert first.choices[0].text
    removed_at = time.monotonic()
    await worker.lose()
    with pytest.raises(openai.APIError) as failure:
        async for _ in stream:
            pass
    assert time.monotonic() - removed_at < 2.0  # not the 30 s idle timeout
    assert "left the cluster" in failure.value.message
    health = (await router.http.get("/health")).json()
    assert health["worker_count"] == 0 and health["in_flight"] == 0


async def test_worker_failure_before_and_after_the_first_byte(router: Router, start_worker) -> None:
    early = await start_worker("w-early", fail="internal", fail_after=0)
    await wait_for_workers(router, 1)
    response = await router.http.post("/v1/completions", json={"model": MODEL_DIR_NAME, "prompt": "hi",
                                                                "stream": True})
    assert response.status_code == 500 and response.json()["error"]["code"] == "internal"

    await early.stop()
    await start_worker("w-late", fail="timeout", fail_after=2)
    async with router.http.stream("POST", "/v1/completions", json={"model": MODEL_DIR_NAME, "prompt": "hi",
                                                                    "stream": True}) as streamed:
        assert streamed.status_code == 200
        events = [line async for line in streamed.aiter_lines() if line.startswith("data: ")]
    assert json.loads(events[-1].removeprefix("data: "))["error"]["code"] == "timeout"
    assert "data: [DONE]" not in events


async def test_client_disconnect_cancels_the_worker_request(router: Router, start_worker) -> None:
    worker = await start_worker(hold=True)
    await wait_for_workers(router, 1)
    body = {"model": MODEL_DIR_NAME, "prompt": "hi", "max_tokens": 50, "stream": True}
    async with router.http.stream("POST", "/v1/completions", json=body) as streamed:
        async for line in streamed.aiter_lines():
            if line.startswith("data: "):
                break  # one chunk in, then hang up
    await wait_for(lambda: worker.cancels, DEADLINE_S, "the worker's cancel")
    assert worker.cancels == [worker.requests[0].request_id]

    # non-streaming: the client gives up while the worker is still generating (its own
    # connection, closed when it gives up: a pooled one may linger open after a cancel)
    body["stream"] = False
    async with httpx.AsyncClient(base_url=router.url, timeout=20) as client:
        request = asyncio.create_task(client.post("/v1/completions", json=body))
        await wait_for(lambda: len(worker.requests) == 2, DEADLINE_S, "the second request")
        request.cancel()
        [ended] = await asyncio.gather(request, return_exceptions=True)
    await wait_for(lambda: len(worker.cancels) == 2, DEADLINE_S,
                   f"the second cancel (the client's request ended with {ended!r}; {worker.state()})")
    assert worker.cancels[-1] == worker.requests[1].request_id
    await wait_until_idle(router)


async def test_health_follows_the_nats_connection_and_serving_resumes(tmp_path, model_dir: str,
                                                                       tokenizer: Tokenizer) -> None:
    nats = EmbeddedNats(str(tmp_path / "nats")).start()  # own server: this test stops it
    bus_config = BusConfig(nats_url=nats.url, namespace="restart")
    test_bus = await connect(nats.url, "test-client")
    # a real worker on this server, heartbeating often: it re-registers after the restart
    config = worker_config("w1", bus_config, model_dir, membership=MembershipConfig(heartbeat_interval_s=0.1, ttl_s=1.0))
    worker = await launch_worker(config, test_bus, tokenizer)
    server = RouterServer(router_config(bus_config, model_dir))
    task = asyncio.create_task(server.serve())
    try:
        await asyncio.wait_for(server.listening.wait(), DEADLINE_S)
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as http:
            async def health_is(status: int, workers: int) -> None:
                async def reached() -> bool:
                    response = await http.get("/health")
                    return response.status_code == status and response.json()["worker_count"] == workers

                await wait_for(reached, DEADLINE_S, f"health {status} with {workers} worker(s)")

            await health_is(200, 1)
            await asyncio.to_thread(nats.stop)
            await health_is(503, 1)
            await asyncio.to_thread(nats.start)  # same port; the memory bucket starts empty
            # the router may be back first, its mirror still naming the worker: wait for the
            # worker's own reconnection (its subscriptions are back), then its heartbeat
            await wait_for(lambda: worker.bus.client.is_connected, DEADLINE_S, "the worker to reconnect")
            await health_is(200, 1)

            # Serving resumes. The router's mirror may still replay the restart (the emptied
            # bucket removes the worker, its next heartbeat adds it back): a request caught
            # in that moment fails with 503 at once, and the next one is served.
            async def served() -> bool:
                response = await http.post("/v1/completions", json={"model": MODEL_DIR_NAME, "prompt": "hi",
                                                                     "max_tokens": 3})
                assert response.status_code in (200, 503), response.text
                return response.status_code == 200

            await wait_for(served, DEADLINE_S, "a request served after the restart")
        await check_idle([worker])
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        await worker.shutdown()
        await test_bus.close()
        nats.stop()
        shutil.rmtree(tmp_path / "nats", ignore_errors=True)
