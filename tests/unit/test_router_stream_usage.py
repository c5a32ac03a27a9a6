"""A stream's usage as vLLM's server (0.32) gives it (`chat_completion/serving.py` and
`completion/serving.py`, `should_include_usage` in `serve/utils/api_utils.py`): with
`stream_options.include_usage` a last chunk with the request's usage; with
`continuous_usage_stats` too, every chunk of a choice carries its prompt's tokens and the
choice's completion tokens so far (a chat's role chunk 0), and the last chunk is unchanged;
`continuous_usage_stats` without `include_usage` adds nothing. Driven through the router's
stream writers (`respond`, `respond_choices`) with scripted generations."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import pytest
from pydantic import ValidationError

from services.router.flows.generation import Delta, Final
from services.router.flows.records import TokenUsage
from services.router.http.answer_format import usage_so_far
from services.router.http.choices import Choice, respond_choices
from services.router.http.serving import respond
from services.router.http.serving_chat import ChatFormat
from services.router.http.serving_completions import CompletionFormat
from services.router.http.sse import UsageSoFar
from services.router.openai.protocol import ChatCompletionRequest, CompletionRequest

CREATED = 1_700_000_000
PROMPT_TOKENS = 5


@dataclass
class Params:
    request_id: str = "r"
    prompt_ids: list[int] = field(default_factory=lambda: list(range(PROMPT_TOKENS)))


class ScriptedGeneration:
    """A `Generation` that gives its pieces in order (what `respond` reads of one)."""

    def __init__(self, *pieces: Delta | Final, prompt_tokens: int = PROMPT_TOKENS) -> None:
        self.params = Params(prompt_ids=list(range(prompt_tokens)))
        self._pieces = list(pieces)
        self.closed = False

    async def next(self) -> Delta | Final:
        await asyncio.sleep(0)
        return self._pieces.pop(0)

    async def close(self) -> None:
        self.closed = True


def script(*completion_tokens: int, prompt_tokens: int = PROMPT_TOKENS) -> ScriptedGeneration:
    """Pieces "t1", "t2", ... each ending at its count of completion tokens; the last one final."""
    *deltas, last = completion_tokens
    return ScriptedGeneration(*(Delta(f"t{i}", (), count) for i, count in enumerate(deltas, 1)),
                              Final("end", "length", TokenUsage(prompt_tokens, last, cached_tokens=2)),
                              prompt_tokens=prompt_tokens)


async def events(response: Any) -> list[dict[str, Any]]:
    """The SSE events a streamed response sends, decoded ([DONE] last, kept as the string)."""
    sent: list[bytes] = []

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()  # the client never leaves
        return {}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message.get("body", b""))

    await response({"type": "http"}, receive, send)
    data = [line.removeprefix("data: ") for line in b"".join(sent).decode().split("\n\n") if line]
    assert data[-1] == "[DONE]"
    return [*map(json.loads, data[:-1]), "[DONE]"]


def usages(chunks: list[Any]) -> list[tuple[int, int, int] | None]:
    return [None if chunk["usage"] is None else
            (chunk["usage"]["prompt_tokens"], chunk["usage"]["completion_tokens"], chunk["usage"]["total_tokens"])
            for chunk in chunks[:-1] if chunk["choices"]]


def last_usage(chunks: list[Any]) -> dict[str, Any]:
    assert chunks[-2]["choices"] == []
    return chunks[-2]["usage"]


def completion_body(**stream_options: bool) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", "stream": True,
                                             "stream_options": stream_options})


async def test_every_completion_chunk_carries_the_usage_so_far_and_the_last_chunk_the_whole() -> None:
    generation = script(1, 3, 4)
    spelled = CompletionFormat("cmpl-1", "m", CREATED, usage_so_far=UsageSoFar(PROMPT_TOKENS))
    chunks = await events(await respond(generation, spelled, stream=True, include_usage=True))
    assert usages(chunks) == [(5, 1, 6), (5, 3, 8), (5, 4, 9)]
    assert set(chunks[0]["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}  # no details
    assert last_usage(chunks) == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9,
                                  "prompt_tokens_details": {"cached_tokens": 2}}
    assert generation.closed


async def test_a_chat_stream_opens_with_a_role_chunk_of_no_completion_tokens() -> None:
    spelled = ChatFormat("chatcmpl-1", "m", CREATED, usage_so_far=UsageSoFar(PROMPT_TOKENS))
    chunks = await events(await respond(script(2, 7), spelled, stream=True, include_usage=True))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert usages(chunks) == [(5, 0, 5), (5, 2, 7), (5, 7, 12)]
    assert last_usage(chunks)["completion_tokens"] == 7


async def test_without_continuous_usage_only_the_last_chunk_has_usage() -> None:
    chunks = await events(await respond(script(1, 3, 4), CompletionFormat("c", "m", CREATED), stream=True,
                                        include_usage=True))
    assert usages(chunks) == [None, None, None] and last_usage(chunks)["total_tokens"] == 9


@pytest.mark.parametrize(("chat", "expected"), [
    (False, {0: [(5, 1, 6), (5, 2, 7)], 1: [(5, 3, 8), (5, 4, 9)], 2: [(8, 2, 10)]}),
    (True, {0: [(5, 0, 5), (5, 1, 6), (5, 2, 7)], 1: [(5, 0, 5), (5, 3, 8), (5, 4, 9)], 2: [(8, 0, 8), (8, 2, 10)]}),
])
async def test_each_choice_counts_its_own_tokens_and_the_last_chunk_each_prompt_once(chat: bool, expected) -> None:
    """Choices 0 and 1 of a prompt of 5 tokens, choice 2 of another prompt of 8."""
    scripted = [(script(1, 2), 0), (script(3, 4), 0), (script(2, prompt_tokens=8), 1)]
    choices = []
    for index, (generation, prompt_index) in enumerate(scripted):
        own = UsageSoFar(len(generation.params.prompt_ids))
        spelled = ChatFormat("c", "m", CREATED, index=index, usage_so_far=own) if chat else \
            CompletionFormat("c", "m", CREATED, index=index, usage_so_far=own)
        choices.append(Choice(generation, spelled, prompt_index))  # type: ignore[arg-type]
    chunks = await events(await respond_choices(choices, stream=True, include_usage=True))
    per_choice: dict[int, list[Any]] = {}
    for chunk, usage in zip([chunk for chunk in chunks[:-1] if chunk["choices"]], usages(chunks), strict=True):
        per_choice.setdefault(chunk["choices"][0]["index"], []).append(usage)
    assert per_choice == expected
    assert last_usage(chunks) == {"prompt_tokens": 13, "completion_tokens": 8, "total_tokens": 21,
                                  "prompt_tokens_details": {"cached_tokens": 4}}


def test_continuous_usage_stats_is_taken_and_needs_include_usage() -> None:
    generation = script(1)
    assert usage_so_far(completion_body(include_usage=True, continuous_usage_stats=True), generation) is not None
    assert usage_so_far(completion_body(include_usage=False, continuous_usage_stats=True), generation) is None
    assert usage_so_far(completion_body(continuous_usage_stats=True), generation) is None
    assert usage_so_far(completion_body(include_usage=True), generation) is None
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "stream": True, "stream_options": {"include_usage": True,
                                                                                    "continuous_usage_stats": True}})
    assert chat.continuous_usage
    with pytest.raises(ValidationError, match="stream_options"):  # as vLLM's server: only with stream
        CompletionRequest.model_validate({"model": "m", "prompt": "hi", "stream_options": {"include_usage": True}})
