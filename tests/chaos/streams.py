"""What the worker-loss chaos tests share: their stack, greedy token prompts, their expected
answers, streamed completions through the official `openai` client, and the check of each outcome.

A stream ends in one of two acceptable ways: complete, with exactly the text an undisturbed
run gives (the sim engine's tokens are a function of the token history, so a request
migrated to another worker still reads the same), or with an explicit error (an HTTP error
status or an SSE error event, which the `openai` client raises as `APIError`). A stream
still open at the test's bound is a hang; a stream that ends without its full text and
without an error is a silent truncation. Both fail the test.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from launch.plan import WorkerSpec
from launch.stack import LocalStack
from services.worker.sim.config import SimEngineConfig
from services.worker.sim.engine import SimEngine
from shared.config import WorkerConfig
from shared.nats_server import EmbeddedNats
from shared.schemas import SamplingParams
from shared.tokenizer import Tokenizer
from tests.e2e.conftest import ALWAYS_DISAGGREGATE
from tests.e2e.test_disaggregated import as_router_text, metric
from tests.stack_fixtures import make_stack, running
from tests.waiting import wait_for


def worker_loss_stack(specs: tuple[WorkerSpec, ...], *, ttl_s: float) -> Callable[..., Iterator[LocalStack]]:
    """A test module's `stack` fixture: a running stack of `specs` workers, every request
    disaggregated, members lost after `ttl_s`."""

    @pytest.fixture
    def stack(nats_server: EmbeddedNats, tiny_model_dir: str, tmp_path: Path) -> Iterator[LocalStack]:
        with running(make_stack(nats_server, tiny_model_dir, tmp_path / "logs", workers=0, specs=specs,
                                router_args=ALWAYS_DISAGGREGATE, ttl_s=ttl_s)) as local:
            yield local

    return stack


@dataclass
class StreamOutcome:
    index: int
    chunks: int = 0  # chunks that carried text
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    ended_at: float | None = None

    @property
    def completed(self) -> bool:
        return self.error is None and self.finish_reason is not None


def token_prompts(tokenizer: Tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    """`count` distinct greedy prompts of 20 to 300 tokens (each at least one full KV block)."""
    vocab = tokenizer.vocab_size - 3
    return [[3 + (seed * 7919 + index * 131 + position * (17 + index % 23)) % vocab
             for position in range(20 + (index * 37) % 281)]
            for index in range(count)]


async def expected_texts(tokenizer: Tokenizer, prompts: Sequence[list[int]], max_tokens: int) -> list[str]:
    """Each prompt's answer as an undisturbed single worker gives it, as the router renders it:
    one sim engine like the workers' running every prompt in one batch."""
    engine = SimEngine(WorkerConfig(worker_id="reference", kv_blocks=16384, max_num_seqs=len(prompts),
                                    max_num_batched_tokens=65536), SimEngineConfig(speedup=1000),
                       model_name=tokenizer.model_name, vocab_size=tokenizer.vocab_size)
    await engine.start()

    async def generate(index: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for output in engine.generate(f"ref-{index}", prompt, SamplingParams(max_tokens=max_tokens)):
            tokens += output.token_ids
        return tokens

    try:
        completions = await asyncio.gather(*(generate(index, prompt) for index, prompt in enumerate(prompts)))
    finally:
        await engine.stop()
    return [as_router_text(tokenizer, prompt, completion) for prompt, completion in zip(prompts, completions)]


async def stream_completion(client: openai.AsyncOpenAI, model: str, prompt: list[int], max_tokens: int,
                            outcome: StreamOutcome) -> StreamOutcome:
    """Stream one greedy completion into `outcome`; never raises for a server-side failure."""
    try:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True)
        async for chunk in stream:
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            if choice.text:
                outcome.text.append(choice.text)
                outcome.chunks += 1
            outcome.finish_reason = choice.finish_reason or outcome.finish_reason
    except openai.APIError as error:  # an HTTP error status or an SSE error event: explicit
        outcome.error = f"{type(error).__name__}: {error}"[:300]
    finally:
        outcome.ended_at = time.monotonic()
    return outcome


def start_streams(client: openai.AsyncOpenAI, model: str, prompts: Sequence[list[int]], max_tokens: int,
                  ) -> tuple[list[asyncio.Task[StreamOutcome]], list[StreamOutcome]]:
    outcomes = [StreamOutcome(index) for index in range(len(prompts))]
    tasks = [asyncio.create_task(stream_completion(client, model, prompt, max_tokens, outcome))
             for prompt, outcome in zip(prompts, outcomes)]
    return tasks, outcomes


async def all_ended(tasks: list[asyncio.Task[StreamOutcome]], outcomes: list[StreamOutcome], deadline: float,
                    what: str) -> None:
    """Every stream ended by the monotonic `deadline`; the open ones are cancelled and named."""
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    hung = [outcome.index for outcome, task in zip(outcomes, tasks) if task in pending]
    assert not hung, f"{len(hung)} streams still open {what}: {hung[:20]}"


def check_outcomes(outcomes: Sequence[StreamOutcome], expected: Sequence[str]) -> tuple[int, int]:
    """Each stream completed with the undisturbed answer or ended with an explicit error;
    returns (completed, errors)."""
    wrong, silent = [], []
    completed = errors = 0
    for outcome, answer in zip(outcomes, expected):
        if outcome.error is not None:
            errors += 1
        elif outcome.finish_reason == "length" and "".join(outcome.text) == answer:
            completed += 1
        elif outcome.finish_reason is None:
            silent.append(outcome.index)
        else:
            wrong.append((outcome.index, outcome.finish_reason, "".join(outcome.text)[:60], answer[:60]))
    assert not silent, f"{len(silent)} streams ended with neither an answer nor an error: {silent[:20]}"
    assert not wrong, f"{len(wrong)} answers differ from an undisturbed run's: {wrong[:3]}"
    return completed, errors


async def router_health(router_url: str) -> dict:
    async with httpx.AsyncClient() as http:
        return (await http.get(f"{router_url}/health", timeout=5)).json()


async def router_members(router_url: str) -> list[str]:
    """The worker ids the router counts as members."""
    return (await router_health(router_url))["workers"]


async def wait_router_idle(router_url: str, timeout_s: float = 10) -> None:
    """Wait until the router has nothing in flight."""

    async def idle() -> bool:
        return (await router_health(router_url))["in_flight"] == 0

    await wait_for(idle, timeout_s, "the router to have nothing in flight")


async def router_metric(router_url: str, name: str, **labels: str) -> float:
    async with httpx.AsyncClient() as http:
        return metric((await http.get(f"{router_url}/metrics", timeout=5)).text, name, **labels)
