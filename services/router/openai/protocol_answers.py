"""The OpenAI HTTP protocol's answers: the response, chunk, usage, model list and error
models the router sends for /v1/completions, /v1/chat/completions and /v1/models (the
request models are in `protocol`). They are plain: built by the router, never parsed.
"""

from __future__ import annotations

import time
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, Field


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class ChunkUsage(BaseModel):
    """A streamed chunk's own usage (`stream_options.continuous_usage_stats`): its prompt's
    tokens and its choice's so far, without details, as vLLM's server spells it."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Usage(ChunkUsage):
    prompt_tokens_details: PromptTokensDetails


ChoiceT = TypeVar("ChoiceT", bound=BaseModel)


class _Answer(BaseModel, Generic[ChoiceT]):
    """What every answer and chunk carries around its choices; each kind fixes its `object`."""

    id: str
    object: str
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChoiceT]
    usage: Usage | ChunkUsage | None = None


def _absent(value: Any) -> bool:
    return value is None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    # vLLM's `return_token_ids`: the prompt's and the answer's tokens (left out when not asked)
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_absent)
    token_ids: list[int] | None = Field(default=None, exclude_if=_absent)
    # vLLM's `prompt_logprobs` (`openai.prompt_logprobs`), where the prompt's were computed
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = Field(default=None, exclude_if=_absent)


class CompletionResponse(_Answer[CompletionChoice]):
    object: Literal["text_completion"] = "text_completion"


# an answer's role: the assistant's, or without add_generation_prompt the last message's (vLLM's rule)
AnswerRole = Literal["system", "developer", "user", "assistant", "tool"]


class ChatResponseMessage(BaseModel):
    role: AnswerRole = "assistant"
    content: str | None
    # the calls the answer made (id, type, function: name and arguments); left out when none
    tool_calls: list[dict[str, Any]] = Field(default_factory=list, exclude_if=lambda calls: not calls)


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(default=None, exclude_if=_absent)  # vLLM's `return_token_ids`


class ChatCompletionResponse(_Answer[ChatChoice]):
    object: Literal["chat.completion"] = "chat.completion"
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_absent)  # vLLM's `return_token_ids`
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = Field(default=None, exclude_if=_absent)


class ChatDelta(BaseModel):
    role: AnswerRole | None = Field(default=None, exclude_if=lambda value: value is None)
    content: str | None = Field(default=None, exclude_if=lambda value: value is None)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(default=None, exclude_if=_absent)  # the chunk's, when asked


class ChatCompletionChunk(_Answer[ChatChunkChoice]):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_absent)  # the first chunk's, when asked


# Streamed completions reuse the response shape, one choice (or none, for usage) per chunk.
CompletionChunk = CompletionResponse


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "tandem"
    max_model_len: int | None = None  # the model's context length, as vLLM's cards carry it (`model_cards`)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
