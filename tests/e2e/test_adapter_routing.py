"""Adapter-aware routing on a stack of three sim workers with one adapter slot each: w1 loads
`alpha` at start, w2 `beta`, w3 none (the whole stack as processes, the official `openai`
client, orchestrator commands as `tandem ctl adapter` sends them).

Each adapter's requests, named `tiny:<adapter>` or by the adapter's own name, go to the
worker holding it (the share is counted from the workers' own generated-token counters); `ctl adapter load` puts an adapter on a worker (its
registration lists it) and its requests follow; a request for an adapter nobody holds goes to
the worker with a free slot, which loads it and registers it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from launch.plan import WorkerSpec
from launch.stack import LocalStack
from shared.nats_server import EmbeddedNats
from shared.schemas.orchestrator import ListWorkers, LoadWorkerAdapter, UnloadWorkerAdapter
from shared.tokenizer import Tokenizer
from tests.e2e.control_plane_helpers import command
from tests.e2e.test_disaggregated import metric, metrics_when
from tests.stack_fixtures import make_stack, running
from tests.waiting import wait_for

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8
REQUESTS = 40
WORKERS = ("w1", "w2", "w3")


@pytest.fixture(scope="module")
def stack(nats_server: EmbeddedNats, tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[LocalStack]:
    specs = (WorkerSpec(worker_id="w1", extra_args=("--max-adapters", "1", "--adapter", "alpha")),
             WorkerSpec(worker_id="w2", extra_args=("--max-adapters", "1", "--adapter", "beta")),
             WorkerSpec(worker_id="w3", extra_args=("--max-adapters", "1")))
    with running(make_stack(nats_server, tiny_model_dir, tmp_path_factory.mktemp("adapter-routing"), workers=0,
                            specs=specs)) as started:
        yield started


async def held(stack: LocalStack) -> dict[str, list[str]]:
    """Per registered worker, the adapters its registration lists."""
    outcome = await command(stack, ListWorkers())
    return {summary.registration.worker_id: summary.registration.adapters for summary in outcome.workers}


async def holding(stack: LocalStack, expected: dict[str, list[str]]) -> None:
    latest: dict[str, list[str]] = {}

    async def shown() -> bool:
        latest.update(await held(stack))
        return latest == expected

    await wait_for(shown, 10.0, lambda: f"registrations listing {expected} (listed: {latest})", interval_s=0.1)


async def generated(http: httpx.AsyncClient, stack: LocalStack) -> dict[str, float]:
    text = (await http.get(f"{stack.metrics_url}/metrics")).text
    return {worker_id: metric(text, "tandem_worker_generated_tokens_total", worker=worker_id) for worker_id in WORKERS}


async def share_per_worker(stack: LocalStack, client, model: str, seed: int) -> dict[str, float]:
    """Send `REQUESTS` distinct prompts for `model`, 8 at a time; each worker's share of them,
    from the tokens the workers report generating meanwhile."""
    async with httpx.AsyncClient() as http:
        before = await generated(http, stack)
        semaphore = asyncio.Semaphore(8)

        async def ask(index: int) -> None:
            prompt = [3 + (seed * 7919 + index * 613 + position * 37) % 2000 for position in range(40 + index)]
            async with semaphore:
                reply = await client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                                        temperature=0, extra_body={"ignore_eos": True})
            assert reply.usage.completion_tokens == MAX_TOKENS

        await asyncio.gather(*(ask(index) for index in range(REQUESTS)))

        def made(after: dict[str, float]) -> dict[str, float]:
            return {worker_id: after[worker_id] - before[worker_id] for worker_id in WORKERS}

        total = REQUESTS * MAX_TOKENS
        latest: dict[str, float] = {}

        async def counted() -> str:
            latest.update(made(await generated(http, stack)))
            return ""

        await metrics_when(counted, lambda _: sum(latest.values()) >= total,
                           lambda _: f"{total} tokens counted (per worker: {latest})")
        assert sum(latest.values()) == total
        return {worker_id: tokens / total for worker_id, tokens in latest.items()}


async def test_each_adapters_requests_go_to_the_worker_holding_it(stack: LocalStack, tiny_model_dir: str,
                                                                  openai_client) -> None:
    model = Tokenizer.from_model_dir(tiny_model_dir).model_name
    client = openai_client(stack.router_url)
    await holding(stack, {"w1": ["alpha"], "w2": ["beta"], "w3": []})
    alpha = await share_per_worker(stack, client, f"{model}:alpha", seed=1)
    beta = await share_per_worker(stack, client, f"{model}:beta", seed=2)
    assert alpha["w1"] >= 0.95, alpha
    assert beta["w2"] >= 0.95, beta
    by_name = await share_per_worker(stack, client, "alpha", seed=5)  # the adapter's own name
    assert by_name["w1"] >= 0.95, by_name


async def test_ctl_loads_an_adapter_and_its_requests_follow(stack: LocalStack, tiny_model_dir: str,
                                                            openai_client) -> None:
    model = Tokenizer.from_model_dir(tiny_model_dir).model_name
    client = openai_client(stack.router_url)
    await holding(stack, {"w1": ["alpha"], "w2": ["beta"], "w3": []})
    loaded = await command(stack, LoadWorkerAdapter(worker_id="w3", adapter="gamma"))
    assert loaded.ok and loaded.workers[0].registration.adapters == ["gamma"], loaded
    assert (await share_per_worker(stack, client, f"{model}:gamma", seed=3))["w3"] >= 0.95

    unloaded = await command(stack, UnloadWorkerAdapter(worker_id="w3", adapter="gamma"))
    assert unloaded.ok and unloaded.workers[0].registration.adapters == [], unloaded
    again = await command(stack, UnloadWorkerAdapter(worker_id="w3", adapter="gamma"))
    assert again.ok and "not loaded" in again.reason  # unchanged: nothing to do

    # nobody holds delta: the worker with a free slot serves it, and loads it
    assert (await share_per_worker(stack, client, f"{model}:delta", seed=4))["w3"] >= 0.95
    await holding(stack, {"w1": ["alpha"], "w2": ["beta"], "w3": ["delta"]})
