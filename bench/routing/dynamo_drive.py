"""The routing bench's workloads driven through a `DynamoStack`, giving the same row figures
as `bench.routing.drive` gives for a Tandem stack (`RunLog.summary()` plus `hit_rate`).

- `stream_answer`: one streamed `/v1/completions` with a token-id prompt, as
  `client.stream_completion` does it (TTFT at the first non-empty text chunk, errors as short
  reasons), that also returns the answer's token ids: Dynamo sends them per chunk when asked
  with `"nvext": {"extra_fields": ["completion_token_ids"]}`. The mocker's answers are random
  ids, so a conversation's next turn carries these, not `workloads.answer_tokens` (the mocker
  caches no answer blocks anyway: a next turn hits its previous prompt's blocks only).
- `run_open_loop`: warm-up requests (bounded concurrency, not measured), then timed arrivals
  (`TimedRequest.at_s`), each its own task; `drain_s` after the last arrival the rest are
  cancelled (errors). Any open-loop workload (`TenantsWorkload.requests`, ...) fits.
- `run_conversations`: `ConversationsWorkload`'s closed loop (users, think times, a
  measured window after one cycle of start-up) with the served answers in the history.

`hit_rate` is the frontend's cached / prompt tokens over the measured requests
(`DynamoCounters`; Dynamo has no pulls, so `pull_rate` is 0). Callers: the bench's Dynamo
rows, and probes by hand.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import httpx
import msgspec
import numpy as np

from bench.routing.client import finish
from bench.routing.dynamo import DynamoCounters, DynamoStack, dynamo_client
from bench.routing.workloads import ConversationsWorkload, EngineShape, Outcome, RunLog, TimedRequest
from bench.serve.client import error_code

_chunk = msgspec.json.Decoder()
TOKEN_IDS = {"extra_fields": ["completion_token_ids"]}


async def stream_answer(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int,
                        outcome: Outcome) -> list[int]:
    """Stream one completion into `outcome`; the answer's token ids (complete only when
    `outcome.error` is None)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "nvext": TOKEN_IDS}
    answer: list[int] = []
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                outcome.error = f"http {response.status_code} {error_code(response.content)}".rstrip()
                return answer
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = _chunk.decode(line[6:])
                if "error" in chunk:
                    outcome.error = f"stream {error_code(line[6:])}"
                    return answer
                if any(choice.get("text") for choice in chunk.get("choices") or ()) and outcome.ttft_s is None:
                    outcome.ttft_s = time.monotonic() - outcome.sent_at
                answer += (chunk.get("nvext") or {}).get("completion_token_ids") or []
                if chunk.get("usage"):
                    outcome.completion_tokens = chunk["usage"]["completion_tokens"]
        if outcome.completion_tokens != max_tokens:
            outcome.error = f"{outcome.completion_tokens} of {max_tokens} tokens"
        else:
            outcome.ended_at = time.monotonic()
    except asyncio.CancelledError:
        outcome.error = "unfinished"
        raise
    except (httpx.HTTPError, msgspec.DecodeError) as error:
        outcome.error = type(error).__name__
    return answer


def cache_figures(before: DynamoCounters, after: DynamoCounters) -> dict:
    used = after - before
    share = used.cached_share
    return {"hit_rate": round(share, 4) if share is not None else None, "pull_rate": 0.0 if share is not None else None,
            "prompt_tokens": used.prompt_tokens}


async def run_open_loop(stack: DynamoStack, warmup: Sequence[TimedRequest], requests: Sequence[TimedRequest], *,
                        concurrency: int, drain_s: float) -> dict:
    async with dynamo_client(stack.base_url) as client:
        gate = asyncio.Semaphore(concurrency)

        async def warm(request: TimedRequest) -> None:
            async with gate:
                await stream_answer(client, stack.model, request.prompt, request.max_tokens,
                                    Outcome(sent_at=time.monotonic()))

        await asyncio.gather(*(warm(request) for request in warmup))
        before = await asyncio.to_thread(stack.counters)
        log, tasks, start = RunLog(), [], time.monotonic()
        for request in requests:
            delay = start + request.at_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            outcome = Outcome(sent_at=time.monotonic())
            log.outcomes.append(outcome)
            tasks.append(asyncio.create_task(
                stream_answer(client, stack.model, request.prompt, request.max_tokens, outcome)))
        await finish(tasks, drain_s)
        after = await asyncio.to_thread(stack.counters)
    return {**log.summary(), **cache_figures(before, after)}


async def run_conversations(stack: DynamoStack, workload: ConversationsWorkload, shape: EngineShape, *,
                            vocab_size: int, seed: int, duration_s: float, drain_s: float) -> dict:
    """As `drive.run_conversations`, each turn's prompt the previous prompt + the served answer
    + the next user message."""
    log = RunLog()
    cycle_s = workload.cycle_s(shape)
    async with dynamo_client(stack.base_url) as client:
        start = time.monotonic()
        window_start, window_end = start + cycle_s, start + cycle_s + duration_s

        async def user(number: int) -> None:
            rng = np.random.default_rng([seed, 7, number])
            await asyncio.sleep(float(rng.uniform(0, cycle_s)))
            for conversation in range(number * 100_000, (number + 1) * 100_000):
                prompt = workload.first_prompt(vocab_size, seed, conversation)
                for turn in range(workload.turns):
                    outcome = Outcome(sent_at=time.monotonic())
                    if outcome.sent_at >= window_end:
                        return
                    if outcome.sent_at >= window_start:
                        log.outcomes.append(outcome)
                    answer = await stream_answer(client, stack.model, prompt, workload.max_tokens, outcome)
                    if outcome.error is not None:
                        break  # this conversation is lost; the user starts another
                    prompt = prompt + answer + workload.user_message(vocab_size, seed, conversation, turn)
                    think_s = workload.think_wall_s(rng, shape.sim_speedup)
                    if time.monotonic() + think_s >= window_end:
                        return
                    await asyncio.sleep(think_s)

        users = [asyncio.create_task(user(number)) for number in range(workload.users(shape))]
        await asyncio.sleep(max(0.0, window_start - time.monotonic()))
        before = await asyncio.to_thread(stack.counters)
        await asyncio.sleep(max(0.0, window_end - time.monotonic()))
        await finish(users, drain_s)
        after = await asyncio.to_thread(stack.counters)
    return {**log.summary(), **cache_figures(before, after)}
