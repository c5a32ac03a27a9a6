"""The admission bench's client side: open-loop Poisson streams, one per API key, each request
a streamed completion whose record names its key (`bench.serve.client` does the HTTP)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

from bench.serve.client import RequestShape, make_client, stream_request
from bench.serve.prompts import PromptSpec, arrival_offsets, build_prompts
from bench.serve.stats import RequestRecord, distribution_ms


@dataclass(frozen=True)
class Stream:
    """One key's offered load in a phase."""

    key_name: str
    api_key: str
    rate_rps: float


@dataclass
class KeyedRecord:
    key_name: str
    record: RequestRecord


async def run_streams(base_url: str, shape: RequestShape, streams: list[Stream], duration_s: float,
                      prompt_tokens: int, seed: int) -> tuple[list[KeyedRecord], float, float]:
    """Send every stream's Poisson arrivals for `duration_s`; the records once all answered,
    and the monotonic times the sending started and stopped."""
    records: list[KeyedRecord] = []
    clients = [make_client(base_url, shape.timeout_s, stream.api_key) for stream in streams]
    started = time.monotonic()
    try:
        await asyncio.gather(*(_one_stream(client, shape, stream, duration_s, prompt_tokens, seed + index, started,
                                           records)
                               for index, (client, stream) in enumerate(zip(clients, streams))))
    finally:
        for client in clients:
            await client.aclose()
    return records, started, started + duration_s


async def _one_stream(client: httpx.AsyncClient, shape: RequestShape, stream: Stream, duration_s: float,
                      prompt_tokens: int, seed: int, started: float, records: list[KeyedRecord]) -> None:
    count = max(1, int(stream.rate_rps * duration_s * 1.5) + 10)
    offsets = [offset for offset in arrival_offsets(count, stream.rate_rps, seed) if offset < duration_s]
    prompts = build_prompts(PromptSpec(count=len(offsets), prompt_tokens=prompt_tokens, seed=seed))
    tasks = []
    for offset, prompt in zip(offsets, prompts):
        await asyncio.sleep(max(0.0, started + offset - time.monotonic()))
        keyed = KeyedRecord(stream.key_name, RequestRecord(sent_at=time.monotonic()))
        records.append(keyed)
        tasks.append(asyncio.create_task(stream_request(client, shape, prompt, keyed.record)))
    await asyncio.gather(*tasks)


def key_summary(records: list[KeyedRecord], key_name: str, window: tuple[float, float]) -> dict:
    """One key's figures: TTFT of its answered requests, refusals by reason, and the tokens
    (prompt and completion) of the requests that ended inside `window` (the share measure)."""
    own = [keyed.record for keyed in records if keyed.key_name == key_name]
    answered = [record for record in own if record.ok]
    errors: dict[str, int] = {}
    for record in own:
        if record.error is not None:
            errors[record.error] = errors.get(record.error, 0) + 1
    in_window = [record for record in answered if window[0] <= (record.ended_at or 0.0) <= window[1]]
    return {"sent": len(own), "answered": len(answered), "errors": errors,
            "ttft_ms": distribution_ms([record.ttft_s for record in answered if record.ttft_s is not None]),
            "window_tokens": sum((record.prompt_tokens or 0) + record.output_tokens for record in in_window),
            "window_requests": len(in_window)}
