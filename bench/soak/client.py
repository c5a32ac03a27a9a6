"""The soak run's HTTP side: sends one `SoakRequest` through an `httpx.AsyncClient` and says
how it ended. Never raises for what the server or the network does.

Outcomes: "ok" (a complete answer: a finish reason, and for a stream the `[DONE]` line),
"cancelled" (the client gave up as the request planned, before the answer was complete),
"error" (an error status, an SSE error event, a truncated answer, a timeout: a hang, or
any exception), with a short reason to count by.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import Literal

import httpx
import msgspec

from bench.serve.client import DataEvents, choice_text, error_code
from bench.soak.workload import SoakRequest

Outcome = Literal["ok", "cancelled", "error"]
_json = msgspec.json.Decoder()


@dataclass(slots=True)
class RequestResult:
    kind: str
    outcome: Outcome
    sent_at: float
    ended_at: float
    error: str = ""
    ttft_s: float | None = None  # streams: send to the first chunk with text
    output_tokens: int = 0

    @property
    def latency_s(self) -> float:
        return self.ended_at - self.sent_at


def request_body(model: str, request: SoakRequest) -> tuple[str, dict]:
    body: dict = {"model": model, "max_tokens": request.max_tokens, "temperature": 0, "stream": request.stream}
    if request.stream:
        body["stream_options"] = {"include_usage": True}
    if request.api == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": request.prompt}]}
    return "/v1/completions", {**body, "prompt": request.prompt}


async def send(client: httpx.AsyncClient, model: str, request: SoakRequest, timeout_s: float) -> RequestResult:
    result = RequestResult(kind=request.kind, outcome="error", sent_at=time.monotonic(), ended_at=0.0)
    try:
        async with asyncio.timeout(timeout_s):
            if request.stream:
                await _stream(client, model, request, result)
            else:
                await _whole(client, model, request, result)
    except TimeoutError:
        if result.outcome != "cancelled":
            result.outcome, result.error = "error", "timeout"
    except Exception as error:  # any failure is one counted error: the run goes on
        result.outcome, result.error = "error", type(error).__name__
    result.ended_at = time.monotonic()
    return result


async def _whole(client: httpx.AsyncClient, model: str, request: SoakRequest, result: RequestResult) -> None:
    path, body = request_body(model, request)
    if request.cancel_after_s is None:
        response = await client.post(path, json=body)
    else:
        try:
            async with asyncio.timeout(request.cancel_after_s):
                response = await client.post(path, json=body)
        except TimeoutError:
            result.outcome = "cancelled"
            return
    if response.status_code != 200:
        result.error = f"http {response.status_code} {error_code(response.content)}".rstrip()
        return
    answer = _json.decode(response.content)
    choices = answer.get("choices") or []
    if not choices or not choices[0].get("finish_reason"):
        result.error = "no finish reason"
        return
    result.outcome = "ok"
    result.output_tokens = int((answer.get("usage") or {}).get("completion_tokens") or 0)


async def _stream(client: httpx.AsyncClient, model: str, request: SoakRequest, result: RequestResult) -> None:
    path, body = request_body(model, request)
    chunks = 0
    finish_reason = None
    async with client.stream("POST", path, json=body) as response:
        stream = DataEvents(response)
        async with aclosing(stream.events()) as events:
            async for event in events:
                for choice in event.get("choices") or ():
                    if choice_text(choice):
                        chunks += 1
                        if result.ttft_s is None:
                            result.ttft_s = time.monotonic() - result.sent_at
                    finish_reason = choice.get("finish_reason") or finish_reason
                usage = event.get("usage")
                if usage:
                    result.output_tokens = int(usage.get("completion_tokens") or 0)
                if request.cancel_after_chunks is not None and chunks >= request.cancel_after_chunks \
                        and finish_reason is None:
                    result.outcome = "cancelled"  # leaving the block closes the connection: the router cancels
                    return
    if stream.error:
        result.error = stream.error
    elif not stream.done:
        result.error = "stream cut before [DONE]"
    elif finish_reason is None:
        result.error = "stream ended without a finish reason"
    else:
        result.outcome = "ok"
