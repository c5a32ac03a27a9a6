"""`/v1/chat/completions`: messages rendered with the model's chat template, one reply."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
from fastapi.responses import Response

from services.router.flows.generation import Delta, Final, Generation
from services.router.flows.records import GenerationParams, RequestIdentity
from services.router.http.answer_format import EndpointFormat, WholeAnswer, prompt_logprobs_of, usage_so_far
from services.router.http.caller import Caller
from services.router.http.chat_images import place_images, read_images
from services.router.http.chat_prompt import chat_prompt
from services.router.http.choices import Choice, answer_choices
from services.router.http.prompt_truncation import truncate_prompt
from services.router.http.serving import ServingContext
from services.router.http.sse import UsageSoFar, finish_json, ids_member, text_json
from services.router.openai.errors import BadRequest
from services.router.openai.logprobs import LogprobsRenderer
from services.router.openai.prompt_logprobs import PromptLogprobs
from services.router.openai.protocol import ChatCompletionRequest
from services.router.openai.protocol_answers import (
    AnswerRole,
    ChatChoice,
    ChatCompletionResponse,
    ChatResponseMessage,
)
from services.router.openai.protocol_messages import NamedToolChoice
from services.router.openai.tool_calls import KEEPS_SPECIAL_TOKENS, ToolCalling, ToolStream
from services.router.openai.tool_parsers import FORMATS
from shared.schemas import TokenLogprobs
from shared.schemas.generate import StructuredOutput

ENDPOINT = "chat"


class ChatFormat(EndpointFormat):
    chunk_object = "chat.completion.chunk"
    answer_type = ChatCompletionResponse

    def __init__(self, request_id: str, model: str, created: int, logprobs: LogprobsRenderer | None = None,
                 index: int = 0, tools: ToolCalling | None = None, usage_so_far: UsageSoFar | None = None,
                 prompt_token_ids: list[int] | None = None, role: AnswerRole = "assistant",
                 prompt_logprobs: Callable[[], PromptLogprobs] | None = None) -> None:
        super().__init__(request_id, model, created, logprobs, index, usage_so_far, prompt_token_ids)
        self._role = role
        self._prompt_logprobs = prompt_logprobs  # vLLM's, rendered once the answer is whole
        self._tools = tools
        self._tool_stream = ToolStream(tools) if tools is not None else None
        self._held: list[TokenLogprobs] = []  # the log-probabilities of text held back (a call may begin there)

    def _chunk(self, delta_json: bytes, completion_tokens: int, finish_reason: str | None = None,
               positions: Sequence[TokenLogprobs] | None = None, token_ids: Sequence[int] | None = (),
               extra_json: bytes = b"") -> bytes:
        """`token_ids`: the chunk's generated tokens (None: a chunk that names none, the role's)."""
        logprobs = b"null"
        if self._logprobs is not None and positions is not None:
            logprobs = msgspec.json.encode({"content": self._logprobs.chat(positions)})
        return self.choice_chunk(b"".join((self._index_json, b',"delta":', delta_json, b',"logprobs":', logprobs,
                                           b',"finish_reason":', finish_json(finish_reason),
                                           b"" if token_ids is None else self.ids_json(token_ids), b"}")),
                                 completion_tokens, extra_json)

    def opening_chunks(self) -> list[bytes]:
        prompt_ids = self.prompt_token_ids
        extra = b"" if prompt_ids is None else ids_member("prompt_token_ids", prompt_ids)  # the first chunk's
        return [self._chunk(b'{"role":"%s","content":""}' % self._role.encode(), 0, token_ids=None, extra_json=extra)]

    def text_chunk(self, piece: Delta) -> bytes:
        tokens = piece.completion_tokens
        if self._tool_stream is None:
            return self._chunk(b"".join((b'{"content":', text_json(piece.text), b"}")), tokens, None, piece.logprobs,
                               piece.token_ids)
        self._held.extend(piece.logprobs)
        text = self._tool_stream.add(piece.text)
        if not text:
            self.hold_ids(piece.token_ids)
            return b""
        positions, self._held = self._held, []
        return self._chunk(b"".join((b'{"content":', text_json(text), b"}")), tokens, None, positions,
                           piece.token_ids)

    def final_chunk(self, piece: Final) -> bytes:
        tokens = piece.usage.completion_tokens
        if self._tool_stream is None:
            return self._chunk(b"".join((b'{"content":', text_json(piece.text), b"}")), tokens, piece.finish_reason,
                               piece.logprobs, piece.token_ids)
        rest, answer = self._tool_stream.finish(piece.text, piece.finish_reason)
        positions = [*self._held, *piece.logprobs]
        if not answer.calls:
            return self._chunk(b"".join((b'{"content":', text_json(rest), b"}")), tokens, answer.finish_reason,
                               positions, piece.token_ids)
        calls = msgspec.json.encode({"tool_calls": [{"index": index, **call} for index, call in enumerate(answer.calls)]})
        text = self._chunk(b"".join((b'{"content":', text_json(rest), b"}")), tokens) if rest else b""
        return text + self._chunk(calls, tokens, answer.finish_reason, positions, piece.token_ids)

    def choice(self, answer: WholeAnswer) -> ChatChoice:
        rendered = {"content": self._logprobs.chat(answer.logprobs)} if self._logprobs is not None else None
        message = ChatResponseMessage(role=self._role, content=answer.text)
        finish_reason = answer.final.finish_reason
        if self._tools is not None:
            calls = self._tools.answer(answer.text, finish_reason)
            message = ChatResponseMessage(role=self._role, content=calls.content, tool_calls=calls.calls)
            finish_reason = calls.finish_reason
        return ChatChoice(index=self.index, message=message, finish_reason=finish_reason, logprobs=rendered,
                          token_ids=answer.token_ids if self.prompt_token_ids is not None else None)

    def answer_members(self) -> dict[str, Any]:
        return {"prompt_token_ids": self.prompt_token_ids,
                "prompt_logprobs": self._prompt_logprobs() if self._prompt_logprobs else None}


class ChatServing:
    def __init__(self, context: ServingContext) -> None:
        self._context = context

    async def create(self, body: ChatCompletionRequest, caller: Caller = Caller()) -> Response:
        context = self._context
        identity = context.identity("chatcmpl", ENDPOINT, body.model)
        created = int(time.time())

        async def start(own: RequestIdentity, index: int) -> Choice:
            generation = await context.start(own, self._prepare(own, body, index, caller))
            return Choice(generation, self._format(identity.request_id, body, created, generation, index), 0)

        return await answer_choices(identity, body.n, start, stream=body.stream, include_usage=body.include_usage)

    async def start_one(self, identity: RequestIdentity, body: ChatCompletionRequest,
                        caller: Caller = Caller()) -> tuple[Generation, ToolCalling | None]:
        """One answer to `body`, started under `identity`, with its tool calling: the path other
        endpoints (the Responses API) take onto the chat's."""
        generation = await self._context.start(identity, self._prepare(identity, body, 0, caller))
        return generation, self._tool_calling(body)  # a refusal of the tools was raised by _prepare

    def _format(self, request_id: str, body: ChatCompletionRequest, created: int, generation: Generation,
                index: int) -> ChatFormat:
        renderer = None if body.logprobs_top is None else LogprobsRenderer(
            self._context.tokenizer_of(body.model), body.logprobs_top, as_token_ids=bool(body.return_tokens_as_token_ids))
        return ChatFormat(request_id, body.model, created, renderer, index, self._tool_calling(body),
                          usage_so_far(body, generation), generation.params.prompt_ids if body.return_token_ids else None,
                          "assistant" if body.add_generation_prompt else body.messages[-1].role,
                          prompt_logprobs_of(generation, self._context.tokenizer_of(body.model), body.prompt_logprobs_top,
                                             clamp=True))

    def _tool_calling(self, body: ChatCompletionRequest) -> ToolCalling | None:
        """The request's tool calling; None without tools. Auto needs the router's format."""
        if not body.tools:
            return None
        parser = self._context.config.tool_call_parser
        if body.chosen_tools == "auto" and not parser:
            raise BadRequest('tool_choice "auto" (the default with tools) needs a router started with '
                             "--tool-call-parser (hermes, llama3_json or mistral), as vLLM's server needs "
                             '--tool-call-parser; or send tool_choice "none", "required" or a named function',
                             param="tool_choice")
        named = body.tool_choice.function.name if isinstance(body.tool_choice, NamedToolChoice) else None
        return ToolCalling(body.chosen_tools, {tool.function.name: tool.function.parameters for tool in body.tools},
                           named, body.parallel_tool_calls is not False, FORMATS.get(parser))

    def _prepare(self, identity: RequestIdentity, body: ChatCompletionRequest, sample: int,
                 caller: Caller) -> Callable[[], Awaitable[GenerationParams]]:
        """The validation of one choice's request (the `sample`-th: seed + `sample`)."""
        context = self._context
        max_tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"

        async def prepare() -> GenerationParams:
            model = await context.resolve_model(body.model)
            tokenizer = model.tokenizer
            images = await read_images(body.messages, tokenizer, context.image_fetcher)
            messages = [message.template_message() for message in body.messages]
            tools = [tool.template_tool() for tool in body.tools] if body.tools else None
            prompt = chat_prompt(tokenizer, body, messages, tools)
            prompt_ids = await context.prompt_ids(tokenizer, prompt, add_special_tokens=body.add_special_tokens, chat=True)
            if images and body.truncate_prompt_tokens is not None:
                raise BadRequest("truncate_prompt_tokens is not served for messages with images",
                                 param="truncate_prompt_tokens")
            prompt_ids = truncate_prompt(context, body, model.name, prompt_ids, added_bos=False,
                                         asks_output=body.requested_max_tokens is not None)
            prompt_ids, placed = place_images(prompt_ids, images, tokenizer)
            prompt_ids = context.check_prompt_ids(tokenizer, prompt_ids, "messages")
            max_tokens = context.max_tokens(body.requested_max_tokens, max_tokens_param)
            params = context.params(identity, body, model, prompt_ids, max_tokens, caller, sample=sample)
            params = dataclasses.replace(params, images=placed) if placed else params
            return _with_tool_calling(params, self._tool_calling(body), context.config.tool_call_parser)

        return prepare


def _with_tool_calling(params: GenerationParams, calling: ToolCalling | None, parser: str) -> GenerationParams:
    """A forced tool choice holds the answer to its JSON schema; formats whose call markers
    are special tokens keep special tokens in the text (as vLLM's server does for them)."""
    if calling is None or calling.use == "none":
        return params
    schema = calling.forced_schema()
    sampling = params.sampling if schema is None else msgspec.structs.replace(
        params.sampling, structured=StructuredOutput(json_schema=json.dumps(schema)))
    keeps_special = parser in KEEPS_SPECIAL_TOKENS
    return dataclasses.replace(params, sampling=sampling,
                               skip_special_tokens=params.skip_special_tokens and not keeps_special)
