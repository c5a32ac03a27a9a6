"""A Responses API request as the chat request the router already serves, and a chat answer as
a response object (pure; `http.serving_responses` does the I/O).

- The conversation: the previous response's (its conversation, then its output) when
  `previous_response_id` names one, then this request's input; system messages are not carried
  on (as vLLM's server drops them), and `instructions` open the chat as a system message.
- Input items become chat messages as vLLM's server builds them: a function call joins the
  assistant message before it (its `tool_calls`), a function call's output is a tool message.
- The answer's text is one `message` item (none when empty), each call a `function_call`
  item; an answer cut by `max_output_tokens` is `incomplete`, as vLLM's server marks it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from services.router.openai.errors import BadRequest
from services.router.openai.protocol import ChatCompletionRequest
from services.router.openai.protocol_messages import ChatMessage
from services.router.openai.protocol_responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ResponsesRequestBase,
    TextConfig,
    TextFormat,
)
from services.router.openai.responses_objects import (
    IncompleteDetails,
    InputTokensDetails,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponseStatus,
    ResponseUsage,
    StoredResponse,
)

OPENAI_DEFAULT_TEMPERATURE = OPENAI_DEFAULT_TOP_P = 1.0
# the chat request's fields the responses request passes on as they are
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "logit_bias", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
                   "structured_outputs", "priority", "cache_salt", "chat_template_kwargs", "user",
                   "parallel_tool_calls")
# where a chat field's refusal names the responses field it came from
RESPONSES_NAME = {"messages": "input", "response_format": "text.format", "max_completion_tokens": "max_output_tokens"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _tool_call(item: FunctionCallItem | OutputFunctionCall) -> dict[str, Any]:
    return {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}


def _append_call(messages: list[dict[str, Any]], item: FunctionCallItem | OutputFunctionCall) -> None:
    """A call joins the assistant message just before it, else opens one of its own."""
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(_tool_call(item))
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [_tool_call(item)]})


def input_messages(items: str | list[Any]) -> list[dict[str, Any]]:
    """The request's input as chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _message_content(item)})
        elif isinstance(item, FunctionCallItem):
            _append_call(messages, item)
        else:
            assert isinstance(item, FunctionCallOutputItem), item
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
    return messages


def _message_content(item: MessageItem) -> str | list[dict[str, str]]:
    """An input message's content as vLLM's server takes it
    (`responses.utils._construct_message_from_response_item`): a client's parts stay parts,
    which the tokenizer joins as the chat template asks (`shared.chat_content`); an earlier
    assistant message's list is its first part's text."""
    if isinstance(item.content, str):
        return item.content
    if item.role == "assistant":
        return (item.content[0].text or "") if item.content else ""
    return [part.chat_part() for part in item.content]


def output_messages(output: list[OutputItem]) -> list[dict[str, Any]]:
    """A stored response's output as the assistant's turn of the conversation."""
    messages: list[dict[str, Any]] = []
    for item in output:
        if isinstance(item, OutputMessage):
            messages.append({"role": "assistant", "content": "".join(part.text or "" for part in item.content)})
        else:
            _append_call(messages, item)
    return messages


def conversation(items: str | list[Any], previous: StoredResponse | None) -> list[ChatMessage]:
    """The chat so far, without this request's instructions: what a stored response keeps."""
    earlier: list[dict[str, Any]] = []
    if previous is not None:
        earlier = [message.model_dump(exclude_none=True) for message in previous.conversation
                   if message.role != "system"]
        earlier += output_messages(previous.response.output)
    return [ChatMessage.model_validate(message) for message in (*earlier, *input_messages(items))]


def _response_format(text_format: TextFormat | None) -> dict[str, Any] | None:
    if text_format is None or text_format.type == "text":
        return None
    if text_format.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": text_format.name or "response", "schema": text_format.schema_}
    if text_format.strict is not None:
        schema["strict"] = text_format.strict
    return {"type": "json_schema", "json_schema": schema}


def chat_request(request: ResponsesRequestBase, model: str, max_tokens: int, messages: list[ChatMessage]) -> ChatCompletionRequest:
    """The chat request that answers `request`; what the chat endpoint
    refuses is a 400 naming the responses field it came from."""
    chat: dict[str, Any] = {name: getattr(request, name) for name in SAMPLING_FIELDS if getattr(request, name) is not None}
    system = [{"role": "system", "content": request.instructions}] if request.instructions else []
    if request.truncation == "auto":  # vLLM's server: as truncate_prompt_tokens -1
        chat["truncate_prompt_tokens"] = -1
    chat.update(model=model, max_completion_tokens=max_tokens,
                messages=[*system, *(message.model_dump(exclude_none=True) for message in messages)])
    if request.tools:
        chat["tools"] = [tool.chat_tool() for tool in request.tools]
    if request.tool_choice is not None:
        choice = request.tool_choice
        chat["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice.name}}
    response_format = _response_format(request.text_format)
    if response_format is not None:
        chat["response_format"] = response_format
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as error:
        first = error.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else None
        param = RESPONSES_NAME.get(field, field) if field else None
        raise BadRequest(str(first["msg"]).removeprefix("Value error, "), param=param) from None


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> ResponseUsage:
    return ResponseUsage(input_tokens=prompt_tokens, output_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens,
                         input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens))


def status_of(finish_reason: str | None) -> tuple[ResponseStatus, IncompleteDetails | None]:
    if finish_reason == "length":
        return "incomplete", IncompleteDetails(reason="max_output_tokens")
    if finish_reason == "cache_threshold":
        return "incomplete", IncompleteDetails(reason="cache_threshold")
    return "completed", None


def output_items(message_id: str, content: str | None, calls: list[dict[str, Any]]) -> list[OutputItem]:
    """The answer's items: its text (none when empty), then each call (as the chat path spells them)."""
    items: list[OutputItem] = []
    if content:
        items.append(OutputMessage(id=message_id, status="completed", content=[OutputText(text=content)]))
    for call in calls:
        items.append(OutputFunctionCall(id=new_id("fc"), call_id=call["id"], name=call["function"]["name"],
                                        arguments=call["function"]["arguments"], status="completed"))
    return items


def response_object(request: ResponsesRequestBase, *, response_id: str, model: str, created_at: int, max_tokens: int,
                    output: list[OutputItem], finish_reason: str | None, usage: ResponseUsage | None) -> ResponseObject:
    """The response to `request`: in progress until it has a `finish_reason`."""
    status, incomplete = status_of(finish_reason) if finish_reason is not None else ("in_progress", None)
    tool_choice = request.tool_choice or ("auto" if request.tools else "none")
    return ResponseObject(
        id=response_id, created_at=created_at, status=status, incomplete_details=incomplete,
        instructions=request.instructions, metadata=request.metadata, model=model, output=output,
        parallel_tool_calls=request.parallel_tool_calls is not False,
        temperature=OPENAI_DEFAULT_TEMPERATURE if request.temperature is None else request.temperature,
        top_p=OPENAI_DEFAULT_TOP_P if request.top_p is None else request.top_p, tool_choice=tool_choice,
        tools=request.tools or [], text=request.text or TextConfig(format=TextFormat(type="text")),
        max_output_tokens=max_tokens, previous_response_id=request.previous_response_id, store=request.store,
        truncation=request.truncation or "disabled", usage=usage, user=request.user)


@dataclass(frozen=True)
class ResponseDraft:
    """The response one request will answer with, named before it is generated: what its
    in-progress and finished objects share (ids, model, time, max tokens)."""

    request: ResponsesRequestBase
    model: str
    created_at: int
    max_tokens: int
    response_id: str = field(default_factory=lambda: new_id("resp"))
    message_id: str = field(default_factory=lambda: new_id("msg"))

    def in_progress(self) -> ResponseObject:
        return response_object(self.request, response_id=self.response_id, model=self.model,
                               created_at=self.created_at, max_tokens=self.max_tokens, output=[], finish_reason=None,
                               usage=None)

    def finished(self, content: str | None, calls: list[dict[str, Any]], finish_reason: str,
                 usage: ResponseUsage) -> ResponseObject:
        return response_object(self.request, response_id=self.response_id, model=self.model,
                               created_at=self.created_at, max_tokens=self.max_tokens,
                               output=output_items(self.message_id, content, calls), finish_reason=finish_reason,
                               usage=usage)
