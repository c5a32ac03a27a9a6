"""Scale to zero: a model with no worker is served once the orchestrator starts one, and goes
back to no worker when idle (the whole stack as processes, the official `openai` client).

The stack has no worker at all. `small` (another vocabulary) is a scalable model: the stack
gives the router and the orchestrator the same `--scalable-model small=DIR`, the orchestrator
a local launcher and `--scale-to-zero-after`. Concurrent requests to `small` are held by the
router, which asks the orchestrator for a worker (`WakeModel`); one worker starts and every
request is answered in full. With no traffic, the orchestrator drains and stops it within the
idle time plus a bound, and the next request starts one again. A model only the router lists
(`ghost`: the orchestrator will not start it) gets a 503 with `Retry-After` as soon as the
orchestrator refuses, never a hang.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from launch.stack import LocalStack
from shared.nats_server import EmbeddedNats, pid_alive
from tests.e2e.control_plane_helpers import back_at_zero, first_token_after, launching_stack, workers_of

pytestmark = pytest.mark.e2e

CONCURRENT = 8
MAX_TOKENS = 6
IDLE_S = 4.0
# past the idle time: the scaler's look (1 s), the drain, the deregistration reaching the bucket
SCALE_DOWN_BOUND_S = 10.0
GHOST_ANSWER_S = 10.0


@pytest.fixture(scope="module")
def zero_stack(nats_server: EmbeddedNats, tiny_model_dir: str, small_model_dir: str,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    yield from launching_stack(nats_server, tiny_model_dir, tmp_path_factory.mktemp("scale-to-zero"),
                               {"small": small_model_dir}, ("--scalable-model", f"ghost={small_model_dir}",
                                                            "--cold-start-wait", "60"), IDLE_S)


async def test_a_model_at_zero_is_answered_once_a_worker_starts_and_returns_to_zero(
        zero_stack: LocalStack, openai_client) -> None:
    stack = zero_stack
    client = openai_client(stack.router_url, timeout=90)
    assert await workers_of(stack, "small") == []
    async with httpx.AsyncClient() as http:
        listed = [card["id"] for card in (await http.get(f"{stack.router_url}/v1/models")).json()["data"]]
    assert "small" in listed, listed

    started = time.monotonic()
    prompts = [[3 + (index * 37 + i * 11) % 1000 for i in range(24 + index)] for index in range(CONCURRENT)]
    answers = await asyncio.gather(*(first_token_after(client, "small", prompt, MAX_TOKENS, started) for prompt in prompts))
    assert all(tokens == MAX_TOKENS for _, _, tokens in answers), answers
    first_tokens = sorted(first for first, _, _ in answers)
    answered_at = time.monotonic()
    [(worker_id, pid, launched)] = await workers_of(stack, "small")
    assert launched and pid_alive(pid)
    print(f"\nscale from zero: {CONCURRENT} concurrent requests, all answered ({MAX_TOKENS} tokens each) by one "
          f"started worker {worker_id}; first request to first token {first_tokens[0]:.2f} s "
          f"(last request's first token {first_tokens[-1]:.2f} s)")

    scaled_down_s, waited = await back_at_zero(stack, "small", [pid], answered_at, IDLE_S, SCALE_DOWN_BOUND_S)
    print(f"scale to zero: no worker of small {scaled_down_s:.2f} s after the last answer "
          f"(idle time {IDLE_S:g} s, bound {IDLE_S + SCALE_DOWN_BOUND_S:g} s; waited {waited:.2f} s)")

    again_started = time.monotonic()
    first, _, tokens = await first_token_after(client, "small", prompts[0], MAX_TOKENS, again_started)
    assert tokens == MAX_TOKENS
    print(f"scale from zero again: first token after {first:.2f} s")


async def test_a_model_no_worker_starts_for_is_a_503_with_retry_after(zero_stack: LocalStack) -> None:
    stack = zero_stack
    async with httpx.AsyncClient(timeout=90) as http:
        started = time.monotonic()
        reply = await http.post(f"{stack.router_url}/v1/completions",
                                json={"model": "ghost", "prompt": "hello", "max_tokens": 2})
        waited = time.monotonic() - started
    assert reply.status_code == 503, reply.text
    assert int(reply.headers["Retry-After"]) >= 1
    assert "not one this orchestrator starts" in reply.json()["error"]["message"], reply.text
    assert waited < GHOST_ANSWER_S, f"held {waited:.1f} s"  # the refusal ends the hold, not the 60 s deadline
