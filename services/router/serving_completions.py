"""`/v1/completions`: a prompt (text or token ids) in, generated text out."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi.responses import Response
from pydantic import BaseModel

from services.router.protocol import CompletionChoice, CompletionChunk, CompletionRequest, CompletionResponse, Usage
from services.router.records import GenerationParams
from services.router.serving import ServingContext, respond

ENDPOINT = "completions"


@dataclass(frozen=True)
class CompletionFormat:
    request_id: str
    model: str

    def opening_chunks(self) -> list[BaseModel]:
        return []

    def text_chunk(self, text: str) -> BaseModel:
        return CompletionChunk(id=self.request_id, model=self.model, choices=[CompletionChoice(text=text)])

    def final_chunk(self, text: str, finish_reason: str) -> BaseModel:
        return CompletionChunk(id=self.request_id, model=self.model,
                               choices=[CompletionChoice(text=text, finish_reason=finish_reason)])

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return CompletionChunk(id=self.request_id, model=self.model, choices=[], usage=usage)

    def response(self, text: str, finish_reason: str, usage: Usage) -> BaseModel:
        return CompletionResponse(id=self.request_id, model=self.model,
                                  choices=[CompletionChoice(text=text, finish_reason=finish_reason)], usage=usage)


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
        return await respond(generation, CompletionFormat(identity.request_id, body.model),
                             stream=body.stream, include_usage=body.include_usage)

