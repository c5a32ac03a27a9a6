"""What the control-plane end-to-end tests share: sending an orchestrator command the way
`tandem ctl` does (timed, for tests that bound how long the orchestrator takes to answer;
for the scale-to-zero tests: a stack with no worker whose orchestrator launches them, a
model's registered workers, a streamed answer's first-token time, the wait for an idle model
to be back at zero workers),
and a pool of streaming clients that keep a stack busy and record every answer (so a test
can tell that none failed or came back short)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import openai

from cli.ctl import send
from launch.stack import LocalStack
from shared.nats_server import EmbeddedNats, pid_alive
from shared.schemas.orchestrator import CommandOutcome, ListWorkers, OrchestratorCommand
from tests.stack_fixtures import make_stack, running
from tests.waiting import wait_for


async def command(stack: LocalStack, order: OrchestratorCommand, timeout_s: float = 30.0) -> CommandOutcome:
    return await send(order, stack.nats_url, stack.config.namespace, timeout_s)


def launching_stack(nats_server: EmbeddedNats, model_dir: str, log_dir: Path, scalable_models: dict[str, str],
                    router_args: tuple[str, ...], idle_s: float) -> Iterator[LocalStack]:
    """A running stack with no worker: its orchestrator starts the `scalable_models` (name ->
    directory, as `--scalable-model` takes it) through a local launcher and stops them after
    `idle_s` without a request."""
    stack = make_stack(nats_server, model_dir, log_dir, workers=0, router_args=router_args)
    settings = {"launcher": "local", "worker_model_dir": model_dir, "worker_log_dir": str(log_dir),
                "scale_to_zero_after": idle_s}
    stack.config = msgspec.structs.replace(stack.config, orchestrator_settings=settings,
                                           scalable_models=scalable_models)
    with running(stack) as local:
        yield local


async def first_token_after(client: openai.AsyncOpenAI, model: str, prompt: list[int], max_tokens: int,
                            started: float) -> tuple[float, str, int]:
    """A streamed completion of `max_tokens` (it must end by length): seconds from `started` to
    its first token, its text and its completion tokens."""
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    first, text, tokens, finish = None, "", 0, None
    async for chunk in stream:
        for choice in chunk.choices:
            if first is None and choice.text:
                first = time.monotonic() - started
            text += choice.text
            finish = choice.finish_reason or finish
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    assert finish == "length" and first is not None, (finish, text)
    return first, text, tokens


async def workers_of(stack: LocalStack, model: str) -> list[tuple[str, int, bool]]:
    """(worker id, pid, launched by the orchestrator) of each registered worker of `model`."""
    listing = await command(stack, ListWorkers())
    return [(s.registration.worker_id, s.registration.pid, s.launched) for s in listing.workers
            if s.registration.model == model]


async def back_at_zero(stack: LocalStack, model: str, pids: Collection[int], answered_at: float, idle_s: float,
                       bound_s: float) -> tuple[float, float]:
    """Waits, at most `idle_s + bound_s`, for `model` to have no registered worker, then for
    its workers' processes (`pids`) to be gone; (seconds from `answered_at`, the last answer,
    to no worker; seconds waited). Not before the idle time: it runs from the orchestrator's
    receipt of the last record, a little before the client's last answer, so a second of
    slack, still far from a scale-down that ignores it."""

    async def at_zero() -> bool:
        return await workers_of(stack, model) == []

    waited = await wait_for(at_zero, idle_s + bound_s, f"the idle model {model} back to zero workers", interval_s=0.2)
    scaled_down_s = time.monotonic() - answered_at
    await wait_for(lambda: not any(pid_alive(pid) for pid in pids), 5, "the stopped workers' processes to be gone")
    assert scaled_down_s >= idle_s - 1.0, f"scaled down {scaled_down_s:.2f} s after the last answer"
    return scaled_down_s, waited


async def timed_command(stack: LocalStack, order: OrchestratorCommand,
                        timeout_s: float = 30.0) -> tuple[CommandOutcome, float]:
    """The orchestrator's outcome of `order`, asserted ok, and the seconds it took to answer."""
    started = time.monotonic()
    outcome = await command(stack, order, timeout_s)
    assert outcome.ok, outcome
    return outcome, time.monotonic() - started


@dataclass
class Answer:
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    error: str = ""


@dataclass
class StreamingLoad:
    """`clients` streaming completions in a loop, each of `max_tokens`, distinct prompts."""

    client: openai.AsyncOpenAI
    model: str
    clients: int = 4
    max_tokens: int = 8
    answers: list[Answer] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._loop(index)) for index in range(self.clients)]

    async def stop(self) -> list[Answer]:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        return self.answers

    async def _loop(self, index: int) -> None:
        turn = 0
        while not self._stop.is_set():
            turn += 1
            prompt = [3 + (index * 97 + turn * 31 + i * 7) % 500 for i in range(40 + 16 * (turn % 4))]
            answer = Answer()
            try:
                stream = await self.client.completions.create(
                    model=self.model, prompt=prompt, max_tokens=self.max_tokens, temperature=0, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
                async for chunk in stream:
                    for choice in chunk.choices:
                        answer.text += choice.text
                        answer.finish_reason = choice.finish_reason or answer.finish_reason
                    if chunk.usage is not None:
                        answer.completion_tokens = chunk.usage.completion_tokens
            except openai.APIError as error:
                answer.error = f"{type(error).__name__}: {error}"
            self.answers.append(answer)

    def wait_answers(self, count: int):
        return lambda: len(self.answers) >= count


def complete(answers: list[Answer], max_tokens: int) -> list[Answer]:
    """The answers that failed or came back short."""
    return [answer for answer in answers
            if answer.error or answer.finish_reason != "length" or answer.completion_tokens != max_tokens]
