"""The routing benchmark's client: streams `/v1/completions` with token-id prompts into an
`Outcome` per request (TTFT at the first non-empty text chunk; an error is a short reason,
never an exception; `headers` go with the request, e.g. the oracle arm's pin), and prints
progress lines on stderr.
"""

from __future__ import annotations

import asyncio
import sys
import time

import httpx
import msgspec

from bench.routing.workloads import Outcome
from bench.serve.client import DataEvents, make_client
from shared.tasks import finish_within

REQUEST_TIMEOUT_S = 300.0


def progress(message: str) -> None:
    print(f"bench_routing: {message}", file=sys.stderr, flush=True)


def router_client(base_url: str) -> httpx.AsyncClient:
    return make_client(base_url, REQUEST_TIMEOUT_S)


async def stream_completion(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int,
                            outcome: Outcome, *, keep_text: bool = False, headers: dict[str, str] | None = None,
                            extra: dict | None = None, answer_ids: list[int] | None = None) -> None:
    """`extra`: more body fields; `answer_ids`: collects the answer's token ids where the
    server sends them per chunk (Dynamo's `nvext.completion_token_ids`)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    try:
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
            stream = DataEvents(response)
            async for chunk in stream.events():
                for choice in chunk.get("choices") or ():
                    text = choice.get("text")
                    if text:
                        if outcome.ttft_s is None:
                            outcome.ttft_s = time.monotonic() - outcome.sent_at
                        if keep_text:
                            outcome.text += text
                if answer_ids is not None:
                    answer_ids += (chunk.get("nvext") or {}).get("completion_token_ids") or []
                if chunk.get("usage"):
                    outcome.completion_tokens = chunk["usage"]["completion_tokens"]
            if stream.error:
                outcome.error = stream.error
                return
        if outcome.completion_tokens != max_tokens:
            outcome.error = f"{outcome.completion_tokens} of {max_tokens} tokens"
        else:
            outcome.ended_at = time.monotonic()
    except asyncio.CancelledError:
        outcome.error = "unfinished"
        raise
    except (httpx.HTTPError, msgspec.DecodeError) as error:
        outcome.error = type(error).__name__


async def finish(tasks: list[asyncio.Task], drain_s: float) -> None:
    """Wait for `tasks` up to `drain_s`; the rest are cancelled (their outcomes say so)."""
    await finish_within(tasks, drain_s)
