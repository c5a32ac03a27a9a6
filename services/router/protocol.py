"""The OpenAI HTTP protocol the router speaks: request, response and chunk models.

Requests are validated strictly (a string where a number belongs is a 400, not a silent
coercion); unknown fields are ignored, as OpenAI's own API and vLLM's server do, so that
clients sending optional knobs Tandem does not implement still work. Fields that would
change the shape of the answer (`n`, `logprobs`, `echo`, `best_of`) are refused unless
left at their defaults. Every field is bounded to what the bus can carry: text must be
encodable as UTF-8 (a lone surrogate such as "\\ud800" is a 400, never a failure later),
integers fit the wire (`seed` a signed 64-bit integer, token ids non-negative 32-bit ones),
and floats are finite where a range bounds them. Response models are plain (built by the
router, never parsed).
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
TOKEN_ID_MAX = 2**31 - 1


def _utf8_encodable(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"must be valid Unicode text: a lone surrogate at position {error.start}") from None
    return text


Text = Annotated[str, AfterValidator(_utf8_encodable)]  # a string the tokenizer and the bus can carry
TokenId = Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)]

# ---- requests ------------------------------------------------------------------------


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingFields(_Request):
    """Fields both generate endpoints share."""

    model: Text
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    # vLLM extensions that benchmark clients send
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    # Tandem extension, decode-first: serve only from a worker already holding at least this
    # share of the prompt's KV; otherwise answer at once with finish_reason "cache_threshold".
    cache_hit_threshold: float | None = Field(default=None, ge=0.0, le=1.0)

    @field_validator("n")
    @classmethod
    def _single_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"must be 1 (one choice per request), got {n}")
        return n

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "SamplingFields":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return tuple(stop for stop in stops if stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    # a string, a list of token ids, or a batch of exactly one of either
    prompt: Text | list[int] | list[Text] | list[list[int]]
    max_tokens: int | None = None
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("not supported")
        return echo

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, logprobs: int | None) -> int | None:
        if logprobs is not None:
            raise ValueError("not supported")
        return logprobs

    @field_validator("best_of")
    @classmethod
    def _one_best_of(cls, best_of: int | None) -> int | None:
        if best_of not in (None, 1):
            raise ValueError(f"must be 1, got {best_of}")
        return best_of

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[int] | list[str] | list[list[int]]):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) and len(prompt) != 1:
            raise ValueError(f"batches are not supported: send one prompt, not {len(prompt)}")
        return prompt

    @property
    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return prompt[0]  # type: ignore[return-value]  # a batch of one
        return prompt  # type: ignore[return-value]


class TextContentPart(_Request):
    type: Literal["text"]
    text: Text


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextContentPart] | None = None
    name: Text | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, logprobs: bool) -> bool:
        if logprobs:
            raise ValueError("not supported")
        return logprobs

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, top_logprobs: int | None) -> int | None:
        if top_logprobs is not None:
            raise ValueError("not supported")
        return top_logprobs

    @property
    def requested_max_tokens(self) -> int | None:
        # max_tokens is deprecated in favour of max_completion_tokens; the new one wins
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- responses -----------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=lambda value: value is None)
    content: str | None = Field(default=None, exclude_if=lambda value: value is None)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


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
