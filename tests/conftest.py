"""Shared fixtures: one real nats-server per test session, a unique namespace per test.

Tests never assume a fixed port: the server picks one, services get port 0 where they
serve HTTP. Each test gets its own subject namespace so tests never see each other.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator

import openai
import pytest

from shared.bus import Bus, connect
from shared.config import BusConfig
from shared.nats_server import EmbeddedNats

pytest_plugins = [
    "tests.integration.router_cluster",  # router fixtures: model_dir, router, start_worker, start_pd (real workers)
    "tests.stack_fixtures",  # whole-stack fixtures: tiny_model_dir, small_model_dir, vision_model_dir
    "tests.trail",  # names the running test in $TANDEM_TEST_TRAIL, for a process that dies natively
]


@pytest.fixture(scope="session")
def nats_server() -> Iterator[EmbeddedNats]:
    with EmbeddedNats() as server:
        yield server


@pytest.fixture
def namespace() -> str:
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture
def bus_config(nats_server: EmbeddedNats, namespace: str) -> BusConfig:
    return BusConfig(nats_url=nats_server.url, namespace=namespace)


@pytest.fixture
async def bus(bus_config: BusConfig) -> AsyncIterator[Bus]:
    async with await connect(bus_config.nats_url, "test-client") as connection:
        yield connection


@pytest.fixture
async def openai_client() -> AsyncIterator[Callable[..., openai.AsyncOpenAI]]:
    """Official openai clients for a router, all closed after the test.

    Never leave one to the garbage collector: an unclosed client collected while other
    clients stream on the same event loop stalled their responses (the whole answer sat
    unread in the client's socket until the read timed out)."""
    clients: list[openai.AsyncOpenAI] = []

    def make(router_url: str, timeout: float = 60.0) -> openai.AsyncOpenAI:
        client = openai.AsyncOpenAI(base_url=f"{router_url}/v1", api_key="unused", max_retries=0, timeout=timeout)
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()
