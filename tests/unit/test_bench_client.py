"""The benchmarks' streaming client judges an answer by its tokens, not by its text: a token
that decodes to no text (a special token, a character's first bytes held back) is an
answer; a stream that ends with no token is not."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from bench.serve.client import RequestShape, stream_request
from bench.serve.stats import RequestRecord

SHAPE = RequestShape(api="completions", model="m", max_tokens=1, timeout_s=5.0)


def server(events: list[dict]) -> httpx.AsyncClient:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions() -> StreamingResponse:
        async def body():
            for event in events:
                yield f"data: {json.dumps(event)}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(body(), media_type="text/event-stream")

    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench")


def chunk(text: str, finish_reason: str | None = None, completion_tokens: int | None = None) -> dict:
    event: dict = {"choices": [{"index": 0, "text": text, "finish_reason": finish_reason}]}
    if completion_tokens is not None:
        event["usage"] = {"prompt_tokens": 5, "completion_tokens": completion_tokens}
    return event


@pytest.mark.parametrize("events, tokens", [
    ([chunk("Hi", "length", 1)], 1),
    ([chunk("", "length", 1)], 1),  # one token, no text
    ([chunk(""), chunk("", "length"), {"choices": [], "usage": {"completion_tokens": 1}}], 1),
    ([chunk("a"), chunk(""), chunk("b", "length", 3)], 3),
])
async def test_an_answer_with_tokens_is_an_answer_whatever_their_text(events: list[dict], tokens: int) -> None:
    record = RequestRecord(sent_at=0.0)
    async with server(events) as client:
        await stream_request(client, SHAPE, "prompt", record)
    assert record.ok and record.error is None
    assert record.output_tokens == tokens and record.ttft_s is not None


@pytest.mark.parametrize("events", [
    [chunk("", "cache_threshold", 0)],
    [],
])
async def test_a_stream_without_a_token_is_an_error(events: list[dict]) -> None:
    record = RequestRecord(sent_at=0.0)
    async with server(events) as client:
        await stream_request(client, SHAPE, "prompt", record)
    assert not record.ok and record.error == "no tokens"
