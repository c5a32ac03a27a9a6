"""What the vLLM stack tests watch (load reports and transfer records of the 1P1D stack,
through tests/stack_fixtures.py's `StackObserver`), and the one way they ask the router
for a completion, and its count of requests split in P/D."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import openai

from bench.serve.main import DISAGGREGATED_METRIC
from launch.stack import LocalStack
from tests.stack_fixtures import StackObserver
from tests.stack_fixtures import observing as observing_stack

ALWAYS_DISAGGREGATE = ("--local-prefill-tokens", "0")  # short prompts too: these tests are about the hand-off
WORKERS = ("p1", "d1")
# Leases far longer than any wait: every lease must end by an explicit release, and a
# request that waited for one to time out would fail the test rather than pass slowly.
LONG_LEASES = ("--kv-lease-ttl", "120")

Observer = StackObserver


async def complete(client: openai.AsyncOpenAI, model: str, prompt: list[int], max_tokens: int) -> str:
    reply = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == max_tokens
    return reply.choices[0].text


@asynccontextmanager
async def observing(stack: LocalStack) -> AsyncIterator[Observer]:
    """An observer of the 1P1D stack, once both workers have reported their load; its
    `assert_clean` allows 20 s, far below the lease TTL: leases were released, not left
    to expire."""
    async with observing_stack(stack, WORKERS, "vllm-test-observer") as observer:
        yield observer


async def disaggregated_requests(router_url: str) -> int:
    """The router's count of requests served by a prefill and a decode worker."""
    return int(sum((await router_samples(router_url, DISAGGREGATED_METRIC)).values()))


async def router_samples(router_url: str, name: str) -> dict[str, float]:
    """The router's samples of metric `name` on `/metrics`: value by label text ("" without labels)."""
    async with httpx.AsyncClient(timeout=10) as client:
        metrics = (await client.get(f"{router_url}/metrics")).text
    samples: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith((name + " ", name + "{")):
            labels, _, value = line[len(name):].rpartition(" ")
            samples[labels.strip()] = float(value)
    return samples
