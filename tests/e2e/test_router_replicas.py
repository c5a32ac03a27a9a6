"""Router replicas, active-active: two `tandem router` processes on one port
(SO_REUSEPORT) in front of sim workers, sharing their predicted load over NATS.

Each router also listens on a port of its own (`router_instance_urls`), so a test can
send a request through one given router and read one given router's metrics. The workers
report their load only every 30 s here, so what a router predicts for a worker is what the
routers routed there (its own requests and its peers'), not a fresh report that would hide
whether the peers' share arrived.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
from openai.types import Completion

from launch.plan import WorkerSpec
from launch.stack import LocalStack
from shared.nats_server import EmbeddedNats
from tests.stack_fixtures import make_stack, running
from tests.waiting import wait_for

pytestmark = pytest.mark.e2e

SLOW_WORKER = ("--load-interval", "30", "--sim-speedup", "0.5",  # ~18 ms a token
               "--caller-check-interval", "1")
WORKERS = (WorkerSpec(worker_id="w1", extra_args=SLOW_WORKER), WorkerSpec(worker_id="w2", extra_args=SLOW_WORKER))
LONG = 400  # tokens: ~7 s a stream (the killed router must expire while the other's streams run)
PEER_EXPIRY_S = 2.0  # four missed heartbeats of 0.5 s (`shared_load.MISSED_HEARTBEATS`)


@pytest.fixture
def replicas(nats_server: EmbeddedNats, tiny_model_dir: str, tmp_path: Path) -> Iterator[LocalStack]:
    stack = make_stack(nats_server, tiny_model_dir, tmp_path / "logs", workers=0, specs=WORKERS)
    with running(LocalStack(msgspec.structs.replace(stack.config, routers=2))) as local:
        yield local


async def predicted_load(router_url: str) -> dict[str, float]:
    """A router's predicted requests per worker (its /metrics)."""
    async with httpx.AsyncClient(timeout=5.0) as http:
        text = (await http.get(f"{router_url}/metrics")).text
    pattern = r'^tandem_router_worker_predicted_load_requests\{[^}]*worker="([^"]+)"[^}]*\} (\S+)$'
    return {worker: float(value) for worker, value in re.findall(pattern, text, re.MULTILINE)}


async def requests_served(router_url: str) -> float:
    async with httpx.AsyncClient(timeout=5.0) as http:
        text = (await http.get(f"{router_url}/metrics")).text
    return sum(float(value) for value in re.findall(r'^tandem_router_requests_total\{[^}]*\} (\S+)$', text,
                                                   re.MULTILINE))


async def load_is(router_url: str, total: float) -> bool:
    return sum((await predicted_load(router_url)).values()) == total


def orphans_cancelled(stack: LocalStack) -> int:
    """Requests the workers cancelled because their caller was gone (from the workers' logs:
    their load reports come only every 30 s here)."""
    return sum(stack.processes[spec.worker_id].log_path.read_text(errors="replace").count(
        "is gone: request cancelled") for spec in WORKERS)


async def first_chunk(client: openai.AsyncOpenAI, prompt: str) -> AsyncIterator[Completion]:
    """A long stream, once its first chunk arrived (the request is routed and running)."""
    stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=LONG, stream=True)
    iterator = stream.__aiter__()
    await iterator.__anext__()
    return iterator


async def drain(iterator: AsyncIterator[Completion]) -> str | None:
    """Read a stream to its end: its finish reason."""
    finish = None
    async for chunk in iterator:
        finish = chunk.choices[0].finish_reason or finish
    return finish


async def test_two_routers_on_one_port_both_serve_and_see_each_others_load(replicas: LocalStack,
                                                                           openai_client) -> None:
    router_a, router_b = (replicas.router_instance_urls[name] for name in ("router", "router-2"))
    # the shared port: the kernel spreads new connections over both routers
    for number in range(16):
        client = openai_client(replicas.router_url)
        answer = await client.completions.create(model="tiny", prompt=f"hello {number}", max_tokens=2)
        assert answer.choices[0].finish_reason == "length"
        await client.close()
    served = [await requests_served(router) for router in (router_a, router_b)]
    assert sum(served) == 16 and min(served) > 0, served

    # a request routed by router A counts in router B's predicted load
    iterator = await first_chunk(openai_client(router_a), "a long story about one router")
    await wait_for(lambda: load_is(router_a, 1), 5.0, "router A counts its own request")
    await wait_for(lambda: load_is(router_b, 1), 5.0, "router B sees router A's request")
    # and one of B's own counts in A's
    iterator_b = await first_chunk(openai_client(router_b), "another story through the other one")
    await wait_for(lambda: load_is(router_a, 2), 5.0, "router A sees router B's request")
    await wait_for(lambda: load_is(router_b, 2), 5.0, "router B counts both")
    assert await drain(iterator) == "length"
    assert await drain(iterator_b) == "length"
    for router in (router_a, router_b):
        await wait_for(lambda router=router: load_is(router, 0), 5.0, "both ended, for both routers")


async def test_a_killed_router_fails_only_its_own_streams_and_its_load_expires(replicas: LocalStack,
                                                                               openai_client) -> None:
    router_b = replicas.router_instance_urls["router-2"]
    killed, survivor = openai_client(replicas.router_instance_urls["router"]), openai_client(router_b)
    doomed = [await first_chunk(killed, f"doomed request {number}") for number in range(3)]
    kept = [await first_chunk(survivor, f"surviving request {number}") for number in range(3)]
    await wait_for(lambda: load_is(router_b, 6), 5.0, "router B counts both routers' requests")

    replicas.processes["router"].popen.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    for iterator in doomed:  # an explicit error, not a truncated success
        with pytest.raises((openai.APIConnectionError, httpx.HTTPError)):
            await drain(iterator)
    # the dead router's requests still count for a while (it may only be slow), then expire
    await wait_for(lambda: load_is(router_b, 3), PEER_EXPIRY_S + 2.0, "the dead router's load expires")
    assert time.monotonic() - killed_at < PEER_EXPIRY_S + 2.0

    # the workers learn the dead router's streams have no reader and cancel them (a check a
    # second), long before their ~7 s of tokens would have run out
    await wait_for(lambda: orphans_cancelled(replicas) == 3, 4.0, "the dead router's requests cancelled")
    assert time.monotonic() - killed_at < 5.0

    # the other router's streams all complete, in full
    finishes = await asyncio.gather(*(drain(iterator) for iterator in kept))
    assert finishes == ["length"] * 3
    # and the shared port keeps serving, through the router left
    for number in range(8):
        client = openai_client(replicas.router_url)
        answer = await client.completions.create(model="tiny", prompt=f"after {number}", max_tokens=2)
        assert answer.choices[0].finish_reason == "length"
        await client.close()
    await wait_for(lambda: load_is(router_b, 0), 5.0, "router B back to nothing in flight")
