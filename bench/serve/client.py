"""The benchmark's HTTP side: streams OpenAI completions or chat completions through one
`httpx.AsyncClient` and fills a `RequestRecord` per request.

A request never raises: an HTTP status, an error event in the stream, a timeout or any
other exception ends it with a short reason in `record.error`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal

import httpx
import msgspec

from bench.serve.stats import RequestRecord

Api = Literal["completions", "chat"]
_json = msgspec.json.Decoder()


@dataclass(frozen=True, slots=True)
class RequestShape:
    """What every request of a run asks for."""

    api: Api
    model: str
    max_tokens: int
    timeout_s: float
    ignore_eos: bool = False  # vLLM's and Tandem's extension, off by default: not OpenAI


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """Closed loop (`concurrency` requests in flight) or open loop (Poisson `arrivals`)."""

    concurrency: int = 1
    arrivals: tuple[float, ...] | None = None  # send offsets in seconds, one per prompt


def make_client(base_url: str, timeout_s: float, api_key: str = "") -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=httpx.Timeout(timeout_s, connect=10.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=512),
                             headers={"Authorization": f"Bearer {api_key}"} if api_key else None)


async def served_model(client: httpx.AsyncClient) -> str:
    """The first model of `/v1/models`."""
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def request_body(shape: RequestShape, prompt: str | list[int]) -> tuple[str, dict]:
    body: dict = {"model": shape.model, "max_tokens": shape.max_tokens, "temperature": 0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if shape.ignore_eos:
        body["ignore_eos"] = True
    if shape.api == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


async def stream_request(client: httpx.AsyncClient, shape: RequestShape, prompt: str | list[int],
                         record: RequestRecord) -> None:
    path, body = request_body(shape, prompt)
    usage: dict | None = None
    try:
        async with asyncio.timeout(shape.timeout_s):
            async with client.stream("POST", path, json=body) as response:
                stream = DataEvents(response)
                async for chunk in stream.events():
                    choices = chunk.get("choices") or ()
                    texts = [choice_text(choice) for choice in choices]
                    if any(texts):
                        record.text_chunk_at.append(time.monotonic())
                        record.text.extend(texts)
                    elif not record.text_chunk_at and any(choice.get("finish_reason") for choice in choices):
                        # every token so far decoded to no text (a special token, or a character's
                        # first bytes, held back and never completed): the end is the first token
                        record.text_chunk_at.append(time.monotonic())
                    usage = chunk.get("usage") or usage
                if stream.error:
                    record.error = stream.error
                    return
        record.ended_at = time.monotonic()
    except (TimeoutError, httpx.TimeoutException):
        record.error = "timeout"
        return
    except Exception as error:  # any failure is one counted error: the run goes on
        record.error = type(error).__name__
        return
    if usage:
        record.output_tokens = int(usage.get("completion_tokens") or 0)
        record.prompt_tokens = usage.get("prompt_tokens")
    else:
        # Tandem's router sends usage (stream_options.include_usage); an endpoint that does not
        # gets one token per text chunk, which undercounts servers that batch tokens in a chunk.
        record.output_tokens = len(record.text_chunk_at)
    if not record.text_chunk_at or not record.output_tokens:
        record.error = "no tokens"


class DataEvents:
    """A streamed answer's `data:` events, decoded, up to `[DONE]`. An error status or an
    error event ends them early, with a short reason in `error`; `done`: `[DONE]` came (a
    stream that ends without it was cut)."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.error = ""
        self.done = False

    async def events(self) -> AsyncIterator[dict]:
        response = self.response
        if response.status_code != 200:
            await response.aread()
            self.error = f"http {response.status_code} {error_code(response.content)}".rstrip()
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                self.done = True
                return
            event = _json.decode(payload)
            if event.get("error"):
                self.error = f"stream {error_code(payload)}".rstrip()
                return
            yield event


def choice_text(choice: dict) -> str:
    """A streamed choice's text: a chat delta's content or a completion's text."""
    if "delta" in choice:  # chat
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def error_code(body: bytes | str) -> str:
    """The OpenAI error body's code (or type): a small set of values, to count."""
    try:
        error = _json.decode(body)["error"]
        return str(error.get("code") or error.get("type") or "")
    except (msgspec.DecodeError, KeyError, TypeError, AttributeError):
        return ""


async def run_requests(client: httpx.AsyncClient, shape: RequestShape, prompts: list[str], plan: LoadPlan,
                       on_done: Callable[[RequestRecord], None] = lambda record: None,
                       ) -> tuple[list[RequestRecord], float]:
    """Send every prompt as `plan` says; the records and the run's duration (first send to
    last answer)."""
    records: list[RequestRecord] = []

    async def send(prompt: str) -> None:
        record = RequestRecord(sent_at=time.monotonic())
        records.append(record)
        await stream_request(client, shape, prompt, record)
        on_done(record)

    start = time.monotonic()
    if plan.arrivals is None:
        pending = iter(prompts)  # shared by the lanes: each takes the next prompt when it is free

        async def lane() -> None:
            for prompt in pending:
                await send(prompt)

        await asyncio.gather(*(lane() for _ in range(min(plan.concurrency, len(prompts)))))
    else:
        assert len(plan.arrivals) == len(prompts), "one arrival per prompt"
        tasks = []
        for offset, prompt in zip(plan.arrivals, prompts):
            await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
            tasks.append(asyncio.create_task(send(prompt)))
        await asyncio.gather(*tasks)
    return records, time.monotonic() - start
