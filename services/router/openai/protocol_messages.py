"""A chat's messages and tools as `/v1/chat/completions` takes them, and each message as the
chat template sees it (as vLLM's server hands it over: content as one string, a past tool
call's arguments as an object)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, model_validator

from services.router.openai.protocol_base import Request, Text


class TextContentPart(Request):
    type: Literal["text"]
    text: Text


class ImageUrl(Request):
    url: Text  # a data URL (`services.router.openai.images`)
    detail: Literal["auto", "low", "high"] | None = None  # taken, as vLLM's server takes it: no model here reads it


class ImageContentPart(Request):
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = TextContentPart | ImageContentPart


class CalledFunction(Request):
    name: Text
    arguments: Text | None = None  # a JSON object, as text


class MessageToolCall(Request):
    """A call an assistant message made earlier in the chat."""

    id: Text
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's
    tool_call_id: Text | None = None  # a tool's answer: to which call

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextContentPart))

    @property
    def image_parts(self) -> list[tuple[int, ImageContentPart]]:
        """The message's image parts, with their places in its content."""
        if not isinstance(self.content, list):
            return []
        return [(index, part) for index, part in enumerate(self.content) if isinstance(part, ImageContentPart)]

    def template_message(self) -> dict[str, Any]:
        """The message as the chat template gets it: text parts stay parts (the tokenizer joins
        them, or not, as the template's content format asks: `shared.chat_content`); an image
        part is `{"type": "image"}`, where a vision-language model's template writes its token."""
        content: str | list[dict[str, str]] = self.text if not isinstance(self.content, list) else [
            {"type": "text", "text": part.text} if isinstance(part, TextContentPart) else {"type": "image"}
            for part in self.content]
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": call.type,
                                      "function": {"name": call.function.name,
                                                   "arguments": _arguments_object(call.function.arguments)}}
                                     for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _arguments_object(arguments: str | None) -> dict[str, Any]:
    """A past call's arguments as templates take them: an object (malformed or not an
    object: empty, as vLLM's server does, so the chat can go on)."""
    try:
        parsed = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


class FunctionDefinition(Request):
    name: Text = Field(min_length=1)
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class ToolDefinition(Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition

    def template_tool(self) -> dict[str, Any]:
        return self.model_dump()


class FunctionName(Request):
    name: Text


class NamedToolChoice(Request):
    type: Literal["function"] = "function"
    function: FunctionName


# Template variables a request may not set: vLLM's server refuses the first two; the others are
# the router's own arguments of the template (the messages, the tools, the two fields below).
_NOT_TEMPLATE_KWARGS = frozenset({"chat_template", "tokenize", "messages", "tools"})


class ChatTemplateFields(Request):
    """How the model's template renders a chat, as vLLM's server takes it (the chat endpoint and
    `/tokenize`): a new assistant turn at the end (`add_generation_prompt`), or the last message
    left open for the model to continue (`continue_final_message`); `chat_template_kwargs` and
    `documents` are variables of the template (those it does not use change nothing)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Text]] | None = None

    @model_validator(mode="after")
    def _open_or_prompted(self) -> "ChatTemplateFields":
        # Only when both are sent: add_generation_prompt defaults to true (vLLM's rule).
        sent_both = self.continue_final_message and "add_generation_prompt" in self.model_fields_set
        if sent_both and self.add_generation_prompt:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        unexpected = _NOT_TEMPLATE_KWARGS & (self.chat_template_kwargs or {}).keys()
        if unexpected:
            raise ValueError(f"Found unexpected chat template kwargs from request: {sorted(unexpected)}")
        return self

    @property
    def add_generation_prompt_now(self) -> bool:
        """Whether to render the assistant's opening: never under an open final message."""
        return self.add_generation_prompt and not self.continue_final_message

    def template_variables(self) -> dict[str, Any]:
        """`chat_template_kwargs`, then `documents` (as vLLM merges them: the request's field wins),
        without the two fields above, which the request's own values always set."""
        variables = {name: value for name, value in (self.chat_template_kwargs or {}).items()
                     if name not in ("add_generation_prompt", "continue_final_message")}
        if self.documents is not None:
            variables["documents"] = self.documents
        return variables
