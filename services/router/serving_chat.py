"""`/v1/chat/completions`: messages rendered with the model's chat template, one reply."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
from fastapi.responses import Response
from pydantic import BaseModel

from services.router.choices import Choice, close_all, respond_choices
from services.router.errors import BadRequest
from services.router.generation import Delta, Final
from services.router.logprobs import LogprobsRenderer
from services.router.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    Usage,
)
from services.router.records import GenerationParams, RequestIdentity
from services.router.serving import ServingContext, respond
from services.router.sse import ChunkPrefix, finish_json, text_json
from shared.schemas import TokenLogprobs

ENDPOINT = "chat"


class ChatFormat:
    def __init__(self, request_id: str, model: str, created: int, logprobs: LogprobsRenderer | None = None,
                 index: int = 0) -> None:
        self.index = index  # the choice's
        self._index_json = b'{"index":' + str(index).encode()
        self.request_id = request_id
        self.model = model
        self.created = created
        self._prefix = ChunkPrefix(request_id, "chat.completion.chunk", created, model)
        self._logprobs = logprobs

    def _chunk(self, delta_json: bytes, finish_reason: str | None = None,
               positions: Sequence[TokenLogprobs] | None = None) -> bytes:
        logprobs = b"null"
        if self._logprobs is not None and positions is not None:
            logprobs = msgspec.json.encode({"content": self._logprobs.chat(positions)})
        return self._prefix.choice(b"".join((self._index_json, b',"delta":', delta_json, b',"logprobs":', logprobs,
                                             b',"finish_reason":', finish_json(finish_reason), b"}")))

    def opening_chunks(self) -> list[bytes]:
        return [self._chunk(b'{"role":"assistant","content":""}')]

    def text_chunk(self, piece: Delta) -> bytes:
        return self._chunk(b"".join((b'{"content":', text_json(piece.text), b"}")), None, piece.logprobs)

    def final_chunk(self, piece: Final) -> bytes:
        return self._chunk(b"".join((b'{"content":', text_json(piece.text), b"}")), piece.finish_reason,
                           piece.logprobs)

    def usage_chunk(self, usage: Usage) -> bytes:
        return self._prefix.usage(usage.model_dump_json().encode())

    def choice(self, text: str, finish_reason: str, logprobs: list[TokenLogprobs]) -> ChatChoice:
        rendered = {"content": self._logprobs.chat(logprobs)} if self._logprobs is not None else None
        return ChatChoice(index=self.index, message=ChatResponseMessage(content=text), finish_reason=finish_reason,
                          logprobs=rendered)

    def response_of(self, choices: list[Any], usage: Usage) -> BaseModel:
        return ChatCompletionResponse(id=self.request_id, model=self.model, created=self.created, usage=usage,
                                      choices=choices)

    def response(self, text: str, finish_reason: str, usage: Usage, logprobs: list[TokenLogprobs]) -> BaseModel:
        return self.response_of([self.choice(text, finish_reason, logprobs)], usage)


class ChatServing:
    def __init__(self, context: ServingContext) -> None:
        self._context = context

    async def create(self, body: ChatCompletionRequest, route_hint: str | None = None) -> Response:
        context = self._context
        identity = context.identity("chatcmpl", ENDPOINT, body.model)
        created = int(time.time())
        if body.n == 1:
            generation = await context.start(identity, self._prepare(identity, body, 0, route_hint))
            return await respond(generation, self._format(identity.request_id, body, created, 0),
                                 stream=body.stream, include_usage=body.include_usage)
        choices: list[Choice] = []
        try:
            for index in range(body.n):
                own = dataclasses.replace(identity, request_id=f"{identity.request_id}-{index}")
                generation = await context.start(own, self._prepare(own, body, index, route_hint))
                choices.append(Choice(generation, self._format(identity.request_id, body, created, index), 0))
        except BaseException:
            await close_all(choices)
            raise
        return await respond_choices(choices, stream=body.stream, include_usage=body.include_usage)

    def _format(self, request_id: str, body: ChatCompletionRequest, created: int, index: int) -> ChatFormat:
        renderer = None if body.logprobs_top is None else LogprobsRenderer(self._context.tokenizer, body.logprobs_top)
        return ChatFormat(request_id, body.model, created, renderer, index)

    def _prepare(self, identity: RequestIdentity, body: ChatCompletionRequest, sample: int,
                 route_hint: str | None) -> Callable[[], Awaitable[GenerationParams]]:
        """The validation of one choice's request (the `sample`-th: seed + `sample`)."""
        context = self._context
        max_tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"

        async def prepare() -> GenerationParams:
            model = context.resolve_model(body.model)
            messages = [{"role": message.role, "content": message.text} for message in body.messages]
            try:
                prompt = context.tokenizer.apply_chat_template(messages)
            except Exception as error:  # a template may reject a conversation (e.g. roles out of order)
                raise BadRequest(f"the chat template cannot render these messages: {error}",
                                 param="messages") from error
            prompt_ids = _without_double_bos(await context.tokenize(prompt), context.tokenizer.bos_token_id)
            prompt_ids = context.check_prompt_ids(prompt_ids, "messages")
            max_tokens = context.max_tokens(body.requested_max_tokens, max_tokens_param)
            return context.params(identity, body, model, prompt_ids, max_tokens, route_hint, sample=sample)

        return prepare


def _without_double_bos(prompt_ids: list[int], bos_token_id: int | None) -> list[int]:
    # A template that renders BOS itself, encoded by a tokenizer that adds BOS too, would
    # start with two; vLLM avoids it by not adding special tokens to rendered chats.
    if bos_token_id is not None and prompt_ids[:2] == [bos_token_id, bos_token_id]:
        return prompt_ids[1:]
    return prompt_ids
