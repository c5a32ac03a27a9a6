"""What the vLLM stack tests watch (load reports and transfer records of the 1P1D stack,
through tests/stack_fixtures.py's `StackObserver`), and the one way they ask the router
for a completion."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import openai

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
