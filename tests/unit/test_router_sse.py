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
from services.router.openai.tool_calls import ToolCalling
from services.router.openai.tool_parsers import FORMATS

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


def test_chunks_with_token_ids_are_the_models_json() -> None:
    """vLLM's `return_token_ids`: a choice's first chunk carries the prompt's ids (chat: the
    stream's first chunk, beside the choices), every chunk its own generated ids."""
    completion = CompletionFormat("c", "m", CREATED, prompt_token_ids=[5, 6])
    assert _event(completion.text_chunk(Delta("x", (), 1, (11,)))) == CompletionChunk(
        id="c", model="m", created=CREATED,
        choices=[CompletionChoice(text="x", prompt_token_ids=[5, 6], token_ids=[11])]).model_dump_json()
    assert _event(completion.final_chunk(Final("y", "stop", TokenUsage(2, 3, 0), (), (12, 13)))) == CompletionChunk(
        id="c", model="m", created=CREATED,
        choices=[CompletionChoice(text="y", finish_reason="stop", token_ids=[12, 13])]).model_dump_json()
    chat = ChatFormat("c", "m", CREATED, prompt_token_ids=[5, 6])
    assert [_event(c) for c in chat.opening_chunks()] == [ChatCompletionChunk(
        id="c", model="m", created=CREATED, choices=[ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))],
        prompt_token_ids=[5, 6]).model_dump_json()]
    assert _event(chat.text_chunk(Delta("x", (), 1, (11,)))) == ChatCompletionChunk(
        id="c", model="m", created=CREATED,
        choices=[ChatChunkChoice(delta=ChatDelta(content="x"), token_ids=[11])]).model_dump_json()
    assert b"token_ids" not in ChatFormat("c", "m", CREATED).text_chunk(Delta("x", (), 1, (11,)))  # not asked


def test_token_ids_of_held_back_text_go_with_the_next_chunk() -> None:
    """A chat with tools holds back text that may open a call: its tokens are not lost."""
    chat = ChatFormat("c", "m", CREATED, tools=ToolCalling("auto", {"f": {}}, None, True, FORMATS["hermes"]),
                      prompt_token_ids=[5])
    assert chat.text_chunk(Delta("<tool", (), 1, (11,))) == b""
    sent = json.loads(_event(chat.final_chunk(Final("x", "stop", TokenUsage(1, 2, 0), (), (12,)))))
    assert sent["choices"][0]["token_ids"] == [11, 12]
