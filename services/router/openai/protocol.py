"""The OpenAI HTTP protocol the router speaks: the request models (the answer and chunk
models are in `protocol_answers`).

Requests are validated strictly (a string where a number belongs is a 400, not a silent
coercion). Nothing is silently ignored: every field OpenAI's API or vLLM's server defines is
honoured, or refused with a 400 naming it unless it has its default (`request_fields`, the
table these models are built from), and a field neither defines is a 400 naming it, as
OpenAI's own API answers. Every field is bounded to what the bus can carry: text must be
encodable as UTF-8 (a lone surrogate such as "\\ud800" is a 400, never a failure later),
integers fit the wire (`seed` a signed 64-bit integer, token ids non-negative 32-bit ones),
and floats are finite where a range bounds them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, cast

from pydantic import AfterValidator, BaseModel, Field, create_model, field_validator, model_validator

from services.router.openai.protocol_base import INT64_MAX, INT64_MIN, TOKEN_ID_MAX, Request, Text, TokenId
from services.router.openai.protocol_messages import ChatMessage, ChatTemplateFields, NamedToolChoice, ToolDefinition
from services.router.openai.request_fields import Endpoint, RequestField, fields_of

MAX_LOGPROBS = 20  # top log-probabilities per token, as vLLM's server allows by default
MAX_CHOICES = 64  # choices per request (n, times the prompts of a batch)
MAX_PROMPTS = MAX_CHOICES

# ---- requests ------------------------------------------------------------------------


class StreamOptions(Request):
    include_usage: bool = False  # a last chunk with the request's usage
    # vLLM's: with include_usage, every chunk carries its choice's usage so far too
    continuous_usage_stats: bool = False


class JsonSchemaSpec(Request):
    name: Text = "response"
    description: Text | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is needed with type json_schema, and only with it")
        return self


class StructuredOutputs(Request):
    """vLLM's `structured_outputs`: exactly one form."""

    json_: dict[str, Any] | Text | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: Text | None = None
    choice: list[Text] | None = Field(default=None, min_length=1)
    grammar: Text | None = None
    disable_any_whitespace: bool = False  # an engine setting in vLLM: refused per request

    @field_validator("disable_any_whitespace")
    @classmethod
    def _engine_setting(cls, disable: bool) -> bool:
        if disable:
            raise ValueError("whitespace in structured JSON is the workers' setting (tandem worker "
                             "--no-vllm-json-whitespace), as vLLM's engine reads it; vLLM's server ignores it here")
        return disable

    @model_validator(mode="after")
    def _one_form(self) -> "StructuredOutputs":
        forms = [self.json_, self.json_object or None, self.regex, self.choice, self.grammar]
        if sum(form is not None for form in forms) != 1:
            raise ValueError("name exactly one of json, json_object, regex, choice, grammar")
        return self


class SamplingFields(Request):
    """Fields both generate endpoints share."""

    model: Text
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)  # choices per prompt
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    user: Text | None = None  # no effect: the client's own end-user id
    # vLLM's extensions of the sampling parameters
    top_k: int | None = Field(default=None, ge=-1, le=TOKEN_ID_MAX)  # -1 or 0: every token
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    min_tokens: int = Field(default=0, ge=0, le=TOKEN_ID_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    bad_words: list[Text] | None = None
    allowed_token_ids: list[TokenId] | None = Field(default=None, min_length=1)
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # Tandem extension, decode-first: serve only from a worker already holding at least this
    # share of the prompt's KV; otherwise answer at once with finish_reason "cache_threshold".
    cache_hit_threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    # vLLM's: lower is served first (0 the default); the router's admission queue orders by it
    priority: int | None = Field(default=None, ge=-(2**31), le=2**31 - 1)
    # vLLM's: the prompt's and the answer's token ids beside the text
    return_token_ids: bool | None = None
    # vLLM's: log-probabilities name tokens `token_id:<id>` instead of by their text
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: the answer keeps the stop string (or stop token's text) that ended it
    include_stop_str_in_output: bool = False
    # vLLM's: a longer prompt keeps this many tokens (-1: as many as the context takes), its
    # last ones unless `truncation_side` is "right" (`openai.truncation`)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    # vLLM's: the prompt tokens' log-probabilities with this many top ones (not streamed)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's: the prompt's KV is shared only with requests of the same salt (`block_hash.chain_root`)
    cache_salt: Text | None = Field(default=None, min_length=1, max_length=1024)

    @model_validator(mode="after")
    def _prompt_logprobs_whole(self) -> "SamplingFields":
        if self.stream and self.prompt_logprobs:
            raise ValueError("`prompt_logprobs` are not available when `stream=True`.")
        return self

    @model_validator(mode="after")
    def _one_structure(self) -> "SamplingFields":
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise ValueError("send response_format or structured_outputs, not both")
        return self

    @model_validator(mode="after")
    def _choices_need_sampling(self) -> "SamplingFields":
        if self.n > 1 and self.temperature == 0:  # as vLLM's server refuses: they would all be the same
            raise ValueError(f"n must be 1 when using greedy sampling (temperature 0), got {self.n}")
        return self

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

    @property
    def continuous_usage(self) -> bool:  # every chunk's usage so far; nothing without include_usage, as vLLM's
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def logprobs_top(self) -> int | None:
        """How many top log-probabilities per token the answer shows; None: none (each endpoint
        spells it its own way)."""
        return None

    @property
    def prompt_logprobs_top(self) -> int | None:
        """The same for the prompt's tokens: vLLM's `prompt_logprobs` (and an echoed completion's)."""
        return self.prompt_logprobs


def _same_value(value: object, allowed: object) -> bool:
    if isinstance(value, bool) or isinstance(allowed, bool):  # True is not 1 here
        return type(value) is type(allowed) and value == allowed
    return value == allowed


def _refuse_unless_default(field: RequestField) -> Any:
    def check(value: object) -> object:
        if value is not None and not any(_same_value(value, allowed) for allowed in field.allowed):
            raise ValueError(f"not supported by Tandem{': ' + field.note if field.note else ''}; "
                             f"remove it or send its default")
        return value

    return (Annotated[Any, AfterValidator(check)], None)


def _with_refused_fields(model: type[BaseModel], endpoint: Endpoint) -> Any:
    """`model` plus the endpoint's refused fields (any value but a default is a 400 naming it)."""
    return with_refused_fields(model, fields_of(endpoint, "refused unless default"))


def with_refused_fields(model: type[BaseModel], refused: dict[str, RequestField], module: str = __name__) -> Any:
    """`model` plus `refused` fields (any value but one of a field's `allowed` is a 400 naming it)."""
    return create_model(model.__name__.removeprefix("_"), __base__=model, __module__=module,
                        **{name: _refuse_unless_default(field) for name, field in refused.items()})


class _CompletionRequest(SamplingFields):
    # a string, a list of token ids, or a batch of exactly one of either
    prompt: Text | list[int] | list[Text] | list[list[int]]
    max_tokens: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # and this many top ones per token
    echo: bool = False  # the answer starts with the prompt (and its log-probabilities, with logprobs)
    add_special_tokens: bool = True  # vLLM's: BOS where the model's tokenizer adds one

    @property
    def prompt_logprobs_top(self) -> int | None:  # as vLLM's server asks its engine
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    @property
    def logprobs_top(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _bounded_batch(cls, prompt: str | list[int] | list[str] | list[list[int]]):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) and len(prompt) > MAX_PROMPTS:
            raise ValueError(f"a batch holds at most {MAX_PROMPTS} prompts, got {len(prompt)}")
        if isinstance(prompt, list) and not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    @model_validator(mode="after")
    def _bounded_choices(self) -> "_CompletionRequest":
        if len(self.prompts) * self.n > MAX_CHOICES:
            raise ValueError(f"a request answers at most {MAX_CHOICES} choices (prompts x n), "
                             f"got {len(self.prompts)} x {self.n}")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts: one, or each of a batch (answered in order, `n` choices each)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            # validation admits only batches all of one kind: texts, or token id lists
            return list(cast("list[str] | list[list[int]]", prompt))
        return [cast("str | list[int]", prompt)]


class _ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool | None = True
    add_special_tokens: bool = False  # vLLM's: the chat template writes the special tokens

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> "_ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _tool_choice_among_tools(self) -> "_ChatCompletionRequest":
        if self.tools == []:
            raise ValueError("tools must not be an empty array: name at least one tool or leave it out")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tools and \
                self.tool_choice.function.name not in {tool.function.name for tool in self.tools}:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not among the tools")
        forms = (self.structured_outputs, self.response_format if self.response_format is None
                 or self.response_format.type != "text" else None)
        if self.chosen_tools in ("required", "named") and any(form is not None for form in forms):
            raise ValueError("a required or named tool call already gives the answer its form: "
                             "send structured output or such a tool_choice, not both")
        return self

    @property
    def chosen_tools(self) -> Literal["none", "auto", "required", "named"]:
        """How the answer uses the tools: none, maybe (auto), at least one call, or the named one."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return "required" if self.tool_choice == "required" else "auto"

    @property
    def logprobs_top(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        # max_tokens is deprecated in favour of max_completion_tokens; the new one wins
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


CompletionRequest = _with_refused_fields(_CompletionRequest, "completions")
ChatCompletionRequest = _with_refused_fields(_ChatCompletionRequest, "chat")
