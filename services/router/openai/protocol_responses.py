"""The request of `/v1/responses` as the router takes it: OpenAI's Responses API, the fields
vLLM's server (0.32) adds, each honoured or refused by the table in `responses_fields`.

Validated as strictly as the chat request (`protocol`): wrong types, unknown fields and
refused values are 400s naming the field. Input is messages (a string, or `input_text` /
`output_text` / `input_image` parts), function calls and their outputs; tools are functions.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from services.router.openai.protocol import with_refused_fields
from services.router.openai.protocol_base import INT64_MAX, INT64_MIN, TOKEN_ID_MAX, Request, Text, TokenId
from services.router.openai.responses_fields import responses_fields

MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's bounds
TEXT_PARTS = ("input_text", "output_text")
PARTS = (*TEXT_PARTS, "input_image")


class ContentPart(Request):
    """A part of a message: the client's text (`input_text`) or image (`input_image`, a data
    URL in `image_url`, as a chat's `image_url` part takes it), or an earlier answer's text
    (`output_text`, whose annotations and log-probabilities describe it and do not change the
    prompt)."""

    type: Text
    text: Text | None = None
    annotations: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None
    image_url: Text | None = None
    detail: Literal["auto", "low", "high"] | None = None

    @field_validator("type")
    @classmethod
    def _served(cls, kind: str) -> str:
        if kind not in PARTS:
            raise ValueError(f"a {kind!r} part is not served: {', '.join(PARTS)}")
        return kind

    @model_validator(mode="after")
    def _filled(self) -> ContentPart:
        if self.type == "input_image":
            if self.image_url is None or self.text is not None:
                raise ValueError("an input_image part holds image_url (a data URL) and no text")
        elif self.text is None or self.image_url is not None or self.detail is not None:
            raise ValueError(f"a {self.type} part holds text and no image")
        return self

    def chat_part(self) -> dict[str, Any]:
        """The part as a chat message's content part."""
        if self.type == "input_image":
            return {"type": "image_url", "image_url": {"url": self.image_url,
                                                       **({"detail": self.detail} if self.detail else {})}}
        return {"type": "text", "text": self.text}


def _text_of(content: str | list[ContentPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text or "" for part in content)


class MessageItem(Request):
    type: Literal["message"] = "message"  # an easy input message names no type
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[ContentPart]
    id: Text | None = None  # an earlier output item's, passed back
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @property
    def text(self) -> str:
        return _text_of(self.content)


class FunctionCallItem(Request):
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(Request):
    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[ContentPart]
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @property
    def text(self) -> str:
        return _text_of(self.output)


def _item_type(item: Any) -> str:
    if isinstance(item, dict):
        return str(item.get("type", "message"))
    return str(getattr(item, "type", "message"))


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                      Discriminator(_item_type, custom_error_type="input_item",
                                    custom_error_message="an input item is a message, function_call or "
                                                         "function_call_output (text only)")]


class FunctionTool(Request):
    type: Literal["function"]
    name: Text = Field(min_length=1)
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, tool: Any) -> Any:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ValueError(f"built-in tool {kind!r} is not served by Tandem: only function tools "
                             "(the router runs no tools itself)")
        return tool

    def chat_tool(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description, "parameters": self.parameters,
                    "strict": self.strict}
        return {"type": "function", "function": {key: value for key, value in function.items() if value is not None}}


class FunctionChoice(Request):
    type: Literal["function"]
    name: Text


class TextFormat(Request):
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: Text | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> TextFormat:
        if (self.type == "json_schema") != (self.schema_ is not None):
            raise ValueError("schema is needed with type json_schema, and only with it")
        return self


class TextConfig(Request):
    format: TextFormat | None = None
    verbosity: None = None  # OpenAI's; no model here has a verbosity setting


class ResponsesRequestBase(Request):
    model: Text | None = None
    input: Annotated[Annotated[Text, Tag("str")] | Annotated[list[InputItem], Tag("list")],
                     Discriminator(lambda value: "str" if isinstance(value, str) else "list")]
    instructions: Text | None = None
    max_output_tokens: int | None = None
    previous_response_id: Text | None = None
    store: bool = True
    stream: bool = False
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool | None = True
    metadata: dict[str, Text] | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"  # None: the default
    user: Text | None = None
    prompt_cache_key: Text | None = None
    # sampling, as the chat endpoint takes it
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=TOKEN_ID_MAX)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    structured_outputs: dict[str, Any] | None = None  # checked as the chat request checks it
    priority: int | None = Field(default=None, ge=-(2**31), le=2**31 - 1)
    cache_salt: Text | None = Field(default=None, min_length=1, max_length=1024)
    chat_template_kwargs: dict[str, Any] | None = None  # checked as the chat request checks it

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        if metadata is None:
            return None
        if len(metadata) > MAX_METADATA_PAIRS:
            raise ValueError(f"at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}")
        if any(len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE for key, value in metadata.items()):
            raise ValueError(f"keys are at most {MAX_METADATA_KEY} characters and values {MAX_METADATA_VALUE}")
        return metadata

    @field_validator("input")
    @classmethod
    def _some_input(cls, value: str | list[Any]) -> str | list[Any]:
        if isinstance(value, list) and not value:
            raise ValueError("the input is empty")
        return value

    @property
    def text_format(self) -> TextFormat | None:
        return None if self.text is None else self.text.format


ResponsesRequest = with_refused_fields(ResponsesRequestBase, responses_fields("refused unless default"), module=__name__)
