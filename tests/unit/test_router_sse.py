"""SSE chunks spelled as bytes (`services.router.http.sse` via the endpoints' formats) are the JSON
the response models in `services.router.openai.protocol_answers` give: same keys, same order, same values."""

from __future__ import annotations

import json

import pytest

from services.router.flows.generation import Delta, Final
from services.router.flows.records import TokenUsage
from services.router.http.serving_chat import ChatFormat
from services.router.http.serving_completions import CompletionFormat
from services.router.http.sse import UsageSoFar
from services.router.openai.protocol_answers import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    ChunkUsage,
    CompletionChoice,
    CompletionChunk,
    PromptTokensDetails,
    Usage,
)

CREATED = 1_700_000_000
TOKENS = TokenUsage(prompt_tokens=7, completion_tokens=3, cached_tokens=0)
TEXTS = ["plain", "", ' quotes " and \\ backslash', "new\nline\ttab", "ünïcode 🙂 漢字", "\u0001 control"]
USAGE = Usage(prompt_tokens=7, completion_tokens=3, total_tokens=10, prompt_tokens_details=PromptTokensDetails(cached_tokens=2))


def _event(chunk: bytes) -> str:
    text = chunk.decode()
    assert text.startswith("data: ") and text.endswith("\n\n") and text.count("\n\n") == 1
    return text[len("data: "):-2]


@pytest.mark.parametrize("text", TEXTS)
def test_completion_chunks_are_the_models_json(text: str) -> None:
    spelled = CompletionFormat("cmpl-1", "the/model", CREATED)
    model = CompletionChunk(id="cmpl-1", model="the/model", created=CREATED, choices=[CompletionChoice(text=text)])
    assert _event(spelled.text_chunk(Delta(text))) == model.model_dump_json()
    final = CompletionChunk(id="cmpl-1", model="the/model", created=CREATED,
                            choices=[CompletionChoice(text=text, finish_reason="length")])
    assert _event(spelled.final_chunk(Final(text, "length", TOKENS))) == final.model_dump_json()
    json.loads(_event(spelled.text_chunk(Delta(text))))  # valid JSON, whatever the text


@pytest.mark.parametrize("text", TEXTS)
def test_chat_chunks_are_the_models_json(text: str) -> None:
    spelled = ChatFormat("chatcmpl-1", "m", CREATED)

    def chunk(delta: ChatDelta, finish_reason: str | None = None) -> str:
        return ChatCompletionChunk(id="chatcmpl-1", model="m", created=CREATED,
                                   choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason)]).model_dump_json()

    assert [_event(c) for c in spelled.opening_chunks()] == [chunk(ChatDelta(role="assistant", content=""))]
    assert _event(spelled.text_chunk(Delta(text))) == chunk(ChatDelta(content=text))
    assert _event(spelled.final_chunk(Final(text, "stop", TOKENS))) == chunk(ChatDelta(content=text), "stop")


def test_usage_chunks_are_the_models_json() -> None:
    assert _event(CompletionFormat("c", "m", CREATED).usage_chunk(USAGE)) == CompletionChunk(
        id="c", model="m", created=CREATED, choices=[], usage=USAGE).model_dump_json()
    assert _event(ChatFormat("c", "m", CREATED).usage_chunk(USAGE)) == ChatCompletionChunk(
        id="c", model="m", created=CREATED, choices=[], usage=USAGE).model_dump_json()


def test_chunks_with_their_usage_so_far_are_the_models_json() -> None:
    """`stream_options.continuous_usage_stats`: the prompt's tokens and the choice's so far."""
    so_far = ChunkUsage(prompt_tokens=7, completion_tokens=2, total_tokens=9)
    completion = CompletionFormat("c", "m", CREATED, usage_so_far=UsageSoFar(7))
    assert _event(completion.text_chunk(Delta("x", (), 2))) == CompletionChunk(
        id="c", model="m", created=CREATED, choices=[CompletionChoice(text="x")], usage=so_far).model_dump_json()
    chat = ChatFormat("c", "m", CREATED, usage_so_far=UsageSoFar(7))
    assert _event(chat.final_chunk(Final("x", "stop", TokenUsage(7, 2, 0)))) == ChatCompletionChunk(
        id="c", model="m", created=CREATED, choices=[ChatChunkChoice(delta=ChatDelta(content="x"), finish_reason="stop")],
        usage=so_far).model_dump_json()
