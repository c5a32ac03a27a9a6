"""Priorities, fair shares and token budgets end to end: a real stack (router, metrics
collector, orchestrator, one sim worker running 2 requests at once, each a process, on the
session's nats-server) whose router queues past its capacity (`--admission-slots-per-seq 1`)
and reads a key file, driven by the official `openai` client.

With both slots held by streams, waiting requests start in priority order (the body's
`priority`, the `X-Tandem-Priority` header, a key's default), a sheddable request (a key's
default past `--sheddable-priority`, which its top priority keeps it in) is refused at once
with 429 and `Retry-After`, and a key past its tokens per minute gets 429 `rate_limited`.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import httpx
import openai
import pytest

from launch.plan import WorkerSpec
from launch.stack import LocalStack
from shared.api_keys import ApiKey, KeyTable, hash_key
from shared.api_keys_file import new_key, write_key_file
from shared.nats_server import EmbeddedNats
from tests.e2e.api_key_helpers import keyed_client, wait_served
from tests.e2e.conftest import make_stack
from tests.stack_fixtures import running
from tests.waiting import wait_for

pytestmark = pytest.mark.e2e

KEYS = {"team": {}, "urgent": {"priority": -1}, "batch": {"priority": 10, "top_priority": 10},
        "metered": {"tpm": 60}}


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    plain = {name: new_key() for name in KEYS}
    path = tmp_path_factory.mktemp("keys") / "api-keys.jsonl"
    write_key_file(path, KeyTable(tuple(ApiKey(name=name, sha256=hash_key(plain[name]), **limits)
                                        for name, limits in KEYS.items())))
    plain["file"] = str(path)
    return plain


@pytest.fixture(scope="module")
def stack(nats_server: EmbeddedNats, tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory,
          keys: dict[str, str]) -> Iterator[LocalStack]:
    router_args = ("--api-keys-file", keys["file"], "--admission-slots-per-seq", "1", "--sheddable-priority", "10")
    planned = make_stack(nats_server, tiny_model_dir, tmp_path_factory.mktemp("admission-stack"), workers=0,
                         specs=(WorkerSpec(worker_id="w1", settings={"max_num_seqs": 2}),), router_args=router_args)
    with running(planned) as local:
        yield local


client = functools.partial(keyed_client, timeout_s=60)


async def waiting(stack: LocalStack) -> int:
    async with httpx.AsyncClient(timeout=10) as http:
        exposition = (await http.get(f"{stack.router_url}/metrics")).text
    line = next(line for line in exposition.splitlines()
                if line.startswith("tandem_router_admission_waiting_requests "))
    return int(float(line.split()[1]))


@asynccontextmanager
async def both_slots_held(stack: LocalStack, api_key: str, model: str) -> AsyncIterator[list]:
    """Two long streams running (the worker's 2 slots, the router's capacity); closed at the end."""
    async with client(stack, api_key) as api:
        streams = [await api.completions.create(model=model, prompt=f"Tell me story {i}", max_tokens=2000,
                                                stream=True) for i in range(2)]
        for stream in streams:
            assert (await anext(aiter(stream))).choices  # running
        try:
            yield streams
        finally:
            for stream in streams:
                await stream.close()


async def test_waiting_requests_start_most_urgent_first_from_field_header_or_key(
        stack: LocalStack, keys: dict[str, str], model: str) -> None:
    finished: list[str] = []

    async def ask(name: str, api_key: str, **options) -> None:
        async with client(stack, api_key) as api:
            completion = await api.completions.create(model=model, prompt="Hello there", max_tokens=2, **options)
        assert completion.usage.completion_tokens == 2
        finished.append(name)

    async with both_slots_held(stack, keys["team"], model) as streams:
        tasks = [asyncio.create_task(ask("low-field", keys["team"], extra_body={"priority": 5}))]
        await wait_for(lambda: waiting(stack), 10, "the first request waiting", interval_s=0.05)
        tasks.append(asyncio.create_task(ask("default", keys["team"])))
        tasks.append(asyncio.create_task(ask("urgent-header", keys["team"],
                                             extra_headers={"X-Tandem-Priority": "-3"})))
        tasks.append(asyncio.create_task(ask("urgent-key", keys["urgent"])))
        await wait_for(lambda: _equals(waiting(stack), 4), 10, "four requests waiting", interval_s=0.05)
        await streams[0].close()  # one slot frees: the queue runs one request at a time
        await asyncio.gather(*tasks)
    assert finished == ["urgent-header", "urgent-key", "default", "low-field"]
    assert await waiting(stack) == 0


async def _equals(value, expected: int) -> bool:
    return await value == expected


async def test_a_sheddable_request_is_refused_at_once_with_retry_after_when_full(
        stack: LocalStack, keys: dict[str, str], model: str) -> None:
    async with client(stack, keys["batch"]) as api:
        async with both_slots_held(stack, keys["team"], model):
            with pytest.raises(openai.RateLimitError) as refused:  # its key's default, 10: sheddable
                await api.completions.create(model=model, prompt="Hello", max_tokens=2)
            assert refused.value.response.headers["retry-after"] == "1"
            with pytest.raises(openai.RateLimitError):  # asking more urgent: held at its key's top priority
                await api.completions.create(model=model, prompt="Hello", max_tokens=2, extra_body={"priority": -5})
        # once the closed streams' slots are back, it runs
        await wait_served(api, model, "Hello", "the sheddable request served once a slot is free")


async def test_a_key_past_its_tokens_per_minute_gets_429_until_its_budget_refills(
        stack: LocalStack, keys: dict[str, str], model: str) -> None:
    async with client(stack, keys["metered"]) as api:
        first = await api.completions.create(model=model, prompt="Hello there", max_tokens=50)  # ~55 of its 60
        assert first.usage.completion_tokens == 50
        await api.completions.create(model=model, prompt="Hello there", max_tokens=50)  # into debt
        with pytest.raises(openai.RateLimitError) as limited:
            await api.completions.create(model=model, prompt="Hello", max_tokens=2)
        assert limited.value.code == "rate_limited" and "tokens/min" in limited.value.message
        assert 1 <= int(limited.value.response.headers["retry-after"]) <= 60


async def test_a_malformed_priority_is_a_400_naming_it(stack: LocalStack, keys: dict[str, str], model: str) -> None:
    async with client(stack, keys["team"]) as api:
        with pytest.raises(openai.BadRequestError) as header:
            await api.completions.create(model=model, prompt="Hello", max_tokens=2,
                                         extra_headers={"X-Tandem-Priority": "high"})
        assert header.value.body["param"] == "x-tandem-priority"
        with pytest.raises(openai.BadRequestError) as field:
            await api.completions.create(model=model, prompt="Hello", max_tokens=2, extra_body={"priority": "high"})
        assert "priority" in field.value.message
