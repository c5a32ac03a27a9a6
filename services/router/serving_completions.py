"""`/v1/completions`: a prompt (text or token ids) in, generated text out."""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec
from fastapi.responses import Response
from pydantic import BaseModel

from services.router.generation import Delta, Final
from services.router.logprobs import LogprobsRenderer
from services.router.protocol import CompletionChoice, CompletionRequest, CompletionResponse, Usage
from services.router.records import GenerationParams
from services.router.serving import ServingContext, respond
from services.router.sse import ChunkPrefix, finish_json, text_json
from shared.schemas import TokenLogprobs

ENDPOINT = "completions"


class CompletionFormat:
    def __init__(self, request_id: str, model: str, created: int, logprobs: LogprobsRenderer | None = None) -> None:
        self.request_id = request_id
        self.model = model
        self.created = created
        self._prefix = ChunkPrefix(request_id, "text_completion", created, model)
        self._logprobs = logprobs

    def opening_chunks(self) -> list[bytes]:
        return []

    def text_chunk(self, piece: Delta) -> bytes:
        return self._choice(piece.text, None, piece.logprobs)

    def final_chunk(self, piece: Final) -> bytes:
        return self._choice(piece.text, piece.finish_reason, piece.logprobs)

    def _choice(self, text: str, finish_reason: str | None, positions: Sequence[TokenLogprobs]) -> bytes:
        logprobs = b"null"
        if self._logprobs is not None:
            logprobs = msgspec.json.encode(self._logprobs.completion(positions))
        return self._prefix.choice(b"".join((b'{"index":0,"text":', text_json(text), b',"logprobs":', logprobs,
                                             b',"finish_reason":', finish_json(finish_reason), b"}")))

    def usage_chunk(self, usage: Usage) -> bytes:
        return self._prefix.usage(usage.model_dump_json().encode())

    def response(self, text: str, finish_reason: str, usage: Usage, logprobs: list[TokenLogprobs]) -> BaseModel:
        rendered = self._logprobs.completion(logprobs) if self._logprobs is not None else None
        return CompletionResponse(id=self.request_id, model=self.model, created=self.created, usage=usage,
                                  choices=[CompletionChoice(text=text, finish_reason=finish_reason, logprobs=rendered)])


class CompletionsServing:
    def __init__(self, context: ServingContext) -> None:
        self._context = context

    async def create(self, body: CompletionRequest, route_hint: str | None = None) -> Response:
        context = self._context
        identity = context.identity("cmpl", ENDPOINT, body.model)

        async def prepare() -> GenerationParams:
            model = context.resolve_model(body.model)
            prompt = body.single_prompt
            if isinstance(prompt, str):
                prompt_ids = await context.tokenize(prompt)
            else:
                prompt_ids = list(prompt)
            prompt_ids = context.check_prompt_ids(prompt_ids, "prompt")
            max_tokens = context.max_tokens(body.max_tokens, "max_tokens")
            return context.params(identity, body, model, prompt_ids, max_tokens, route_hint)

        generation = await context.start(identity, prepare)
        renderer = None if body.logprobs_top is None else LogprobsRenderer(context.tokenizer, body.logprobs_top)
        return await respond(generation, CompletionFormat(identity.request_id, body.model, int(time.time()), renderer),
                             stream=body.stream, include_usage=body.include_usage)

