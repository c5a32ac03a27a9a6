"""The request and response models of `/tokenize` and `/detokenize`, in vLLM's shapes.

`POST /tokenize` takes a completion prompt (`TokenizeCompletionRequest`) or a chat
(`TokenizeChatRequest`, told apart by its `messages`) and answers `TokenizeResponse`;
`POST /detokenize` takes `DetokenizeRequest` and answers `DetokenizeResponse`. Field names
and defaults are vLLM's (`add_special_tokens` is true for a prompt, false for a chat, whose
template writes its own special tokens). Validation is as strict as the generate
endpoints' (`services.router.openai.protocol`), and nothing is silently ignored: a field vLLM's
models do not define is a 400 naming it, and so is one Tandem cannot honour unless it has
its default: a chat template sent with the request (vLLM refuses one too unless told to
trust it), multimodal options, and token strings. Tools are
rendered into a chat as `/v1/chat/completions` renders them.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from services.router.openai.protocol import ChatMessage, Text, TokenId
from services.router.openai.protocol_messages import ChatTemplateFields, ToolDefinition

# vLLM refuses one too, unless started with --trust-request-chat-template (Tandem has no such flag)
UNTRUSTED_TEMPLATE = "not supported: the router renders chats with the model's own template"


def _unless_empty(value: Any) -> Any:
    if value:
        raise ValueError("not supported by Tandem's /tokenize; remove it or send it empty")
    return value


class _TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: Text | None = None  # None: the router's own model
    return_token_strs: bool | None = False

    @field_validator("return_token_strs")
    @classmethod
    def _no_token_strs(cls, return_token_strs: bool | None) -> bool | None:
        if return_token_strs:
            raise ValueError("not supported: the router returns token ids only")
        return return_token_strs


class TokenizeCompletionRequest(_TokenizeRequest):
    prompt: Text
    add_special_tokens: bool = True  # BOS, when the model's tokenizer adds one


class TokenizeChatRequest(_TokenizeRequest, ChatTemplateFields):
    """A chat rendered as `/v1/chat/completions` renders it (`ChatTemplateFields`: the generation
    prompt or an open final message, the template's variables; the tools)."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_special_tokens: bool = False  # on top of what the chat template writes
    chat_template: Text | None = None
    tools: list[ToolDefinition] | None = None
    media_io_kwargs: Annotated[dict[str, Any] | None, AfterValidator(_unless_empty)] = None
    mm_processor_kwargs: Annotated[dict[str, Any] | None, AfterValidator(_unless_empty)] = None

    @field_validator("chat_template")
    @classmethod
    def _no_request_template(cls, chat_template: str | None) -> str | None:
        if chat_template is not None:
            raise ValueError(UNTRUSTED_TEMPLATE)
        return chat_template


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: Text | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str
