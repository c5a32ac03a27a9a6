"""The two workloads driven against a running stack: open-loop tenants (Poisson arrivals)
and closed-loop multi-turn conversations. Each returns its result row's figures.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx
import numpy as np

from bench.routing.client import finish, progress, router_client, stream_completion
from bench.routing.counters import cache_figures, read_counters, settled_counters
from bench.routing.workloads import (
    ConversationsWorkload,
    EngineShape,
    Outcome,
    RunLog,
    TenantsWorkload,
    TimedRequest,
    answer_tokens,
)
from services.worker.sim.tokens import fold_tokens


@dataclass(frozen=True)
class Run:
    router_url: str
    metrics_url: str
    model: str
    model_dir: str
    vocab_size: int
    seed: int
    duration_s: float
    drain_s: float
    rate_rps: float


async def run_tenants(run: Run, workload: TenantsWorkload, concurrency: int) -> dict:
    async with router_client(run.router_url) as client, httpx.AsyncClient() as http:
        gate = asyncio.Semaphore(concurrency)

        async def warm(request: TimedRequest) -> Outcome:
            async with gate:
                outcome = Outcome(sent_at=time.monotonic())
                await stream_completion(client, run.model, request.prompt, request.max_tokens, outcome)
                return outcome

        warmup = await asyncio.gather(*(warm(request) for request in workload.warmup(run.vocab_size, run.seed)))
        failed = sum(outcome.error is not None for outcome in warmup)
        if failed:
            progress(f"  warm-up: {failed} of {len(warmup)} requests failed")
        before = await settled_counters(http, run.metrics_url)
        log = RunLog()
        tasks: list[asyncio.Task] = []
        start = time.monotonic()
        for request in workload.requests(run.vocab_size, run.seed, run.rate_rps, run.duration_s):
            delay = start + request.at_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            outcome = Outcome(sent_at=time.monotonic())
            log.outcomes.append(outcome)
            tasks.append(asyncio.create_task(
                stream_completion(client, run.model, request.prompt, request.max_tokens, outcome)))
        await finish(tasks, run.drain_s)
        after = await settled_counters(http, run.metrics_url)
    return {**log.summary(), **cache_figures(before, after)}


async def run_conversations(run: Run, workload: ConversationsWorkload, shape: EngineShape) -> dict:
    """Users start over one think-and-answer cycle (not measured: every first turn of that
    phase misses for every policy), then turns sent during the window are measured."""
    log = RunLog()
    mismatches: list[int] = []
    cycle_s = workload.cycle_s(shape)
    async with router_client(run.router_url) as client, httpx.AsyncClient() as http:
        start = time.monotonic()
        window_start, window_end = start + cycle_s, start + cycle_s + run.duration_s

        async def user(number: int) -> None:
            rng = np.random.default_rng([run.seed, 7, number])
            await asyncio.sleep(float(rng.uniform(0, cycle_s)))
            for conversation in range(number * 100_000, (number + 1) * 100_000):
                prompt = workload.first_prompt(run.vocab_size, run.seed, conversation)
                state = fold_tokens(prompt)
                for turn in range(workload.turns):
                    outcome = Outcome(sent_at=time.monotonic())
                    if outcome.sent_at >= window_end:
                        return
                    if outcome.sent_at >= window_start:
                        log.outcomes.append(outcome)
                    check = number == 0 and turn == 0 and not mismatches  # is the predicted answer the one served?
                    await stream_completion(client, run.model, prompt, workload.max_tokens, outcome, keep_text=check)
                    if outcome.error is not None:
                        break  # this conversation is lost; the user starts another
                    answer, state = answer_tokens(state, workload.max_tokens, run.vocab_size)
                    if check and not _served_as_predicted(run.model_dir, prompt, answer, outcome.text):
                        mismatches.append(conversation)
                    message = workload.user_message(run.vocab_size, run.seed, conversation, turn)
                    prompt = prompt + answer + message
                    state = fold_tokens(message, state)
                    think_s = workload.think_wall_s(rng, shape.sim_speedup)
                    if time.monotonic() + think_s >= window_end:
                        return
                    await asyncio.sleep(think_s)

        users = [asyncio.create_task(user(number)) for number in range(workload.users(shape))]
        await asyncio.sleep(max(0.0, window_start - time.monotonic()))
        before = await read_counters(http, run.metrics_url)
        await asyncio.sleep(max(0.0, window_end - time.monotonic()))
        await finish(users, run.drain_s)
        after = await settled_counters(http, run.metrics_url)
    if mismatches:
        progress("  WARNING: the served answer differs from the sim's predicted one: later turns are not the "
                  "exact continuation of earlier ones (the hit rate understates reuse)")
    return {**log.summary(), **cache_figures(before, after)}


def _served_as_predicted(model_dir: str, prompt: list[int], answer: list[int], served_text: str) -> bool:
    """Whether the text served for `prompt` is `answer`, the sim's predicted answer, detokenized."""
    from services.router.flows.detokenizer import IncrementalDetokenizer
    from shared.tokenizer import Tokenizer

    detokenizer = IncrementalDetokenizer(Tokenizer.from_model_dir(model_dir), prompt)
    return detokenizer.push(answer) + detokenizer.finish() == served_text
