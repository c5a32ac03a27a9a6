"""What `/v1/responses` answers: the response object, its output items and usage, the events of
a streamed one, and the record a stored response keeps (`StoredResponse`).

Shaped as vLLM's server (0.32) and OpenAI's API spell them. Built by the router; a stored one
is parsed back (`StoredResponse.model_validate_json`) when it is retrieved or continued.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from services.router.openai.protocol_messages import ChatMessage
from services.router.openai.protocol_responses import FunctionChoice, FunctionTool, TextConfig

ResponseStatus = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = Annotated[OutputMessage | OutputFunctionCall, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # no reasoning parser in the router: always 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: str  # max_output_tokens; Tandem's cache_threshold (decode-first, nothing generated)


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    metadata: dict[str, str] | None = None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice
    tools: list[FunctionTool]
    text: TextConfig
    max_output_tokens: int
    previous_response_id: str | None = None
    background: bool = False
    reasoning: None = None
    service_tier: Literal["auto"] = "auto"
    store: bool
    top_logprobs: int = 0
    truncation: Literal["auto", "disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None


class StoredResponse(BaseModel):
    """A stored response and the conversation it answered (its input after earlier turns, as
    chat messages; the instructions are not carried on, as OpenAI's and vLLM's are not)."""

    response: ResponseObject
    conversation: list[ChatMessage]


# ---- streamed events -----------------------------------------------------------------


class ResponseEvent(BaseModel):
    type: str
    sequence_number: int = 0  # set as the event is sent


class ResponseLifecycleEvent(ResponseEvent):
    type: Literal["response.created", "response.in_progress", "response.completed"]
    response: ResponseObject


class OutputItemEvent(ResponseEvent):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class _ItemEvent(ResponseEvent):
    """An event about one output item: its id and its place in the response's output."""

    item_id: str
    output_index: int


class _ContentEvent(_ItemEvent):
    """An event about one content part of an output message (the router writes one per message: index 0)."""

    content_index: int = 0


class ContentPartEvent(_ContentEvent):
    type: Literal["response.content_part.added", "response.content_part.done"]
    part: OutputText


class TextDeltaEvent(_ContentEvent):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    delta: str
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class TextDoneEvent(_ContentEvent):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    text: str
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ArgumentsDeltaEvent(_ItemEvent):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    delta: str


class ArgumentsDoneEvent(_ItemEvent):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    name: str
    arguments: str


class ErrorEvent(ResponseEvent):
    type: Literal["error"] = "error"
    code: str | None
    message: str
    param: str | None = None
