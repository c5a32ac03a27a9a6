"""`/v1/completions`: a prompt (text or token ids) in, generated text out.

With `echo`, the answer starts with the prompt (its text as sent, or the decoding of its
token ids), and with `logprobs` too, with the prompt tokens' log-probabilities (the first
has none), which the worker that computed the prompt sends with the first token."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi.responses import Response
from pydantic import BaseModel

from services.router.generation import Delta, Final, Generation
from services.router.logprobs import LogprobsRenderer
from services.router.protocol import CompletionChoice, CompletionRequest, CompletionResponse, Usage
from services.router.records import GenerationParams
from services.router.serving import ServingContext, respond
from services.router.sse import ChunkPrefix, finish_json, text_json
from shared.schemas import TokenLogprobs

ENDPOINT = "completions"


@dataclass
class EchoedPrompt:
    text: str
    token_ids: list[int]
    generation: Generation  # its `prompt_logprobs` are known once its first piece is


class CompletionFormat:
    def __init__(self, request_id: str, model: str, created: int, logprobs: LogprobsRenderer | None = None,
                 echo: EchoedPrompt | None = None) -> None:
        self.request_id = request_id
        self.model = model
        self.created = created
        self._prefix = ChunkPrefix(request_id, "text_completion", created, model)
        self._logprobs = logprobs
        self._echo = echo  # until the first piece is spelled

    def _with_echo(self, text: str, positions: Sequence[TokenLogprobs]) -> tuple[str, dict[str, Any] | None]:
        """The piece's text and rendered log-probabilities, after the prompt's for the first piece."""
        echo, self._echo = self._echo, None
        rendered = None
        if self._logprobs is not None:
            rendered = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            if echo is not None:
                assert echo.generation.prompt_logprobs is not None, "the first frame had no prompt log-probabilities"
                _extend(rendered, self._logprobs.prompt(echo.token_ids, echo.generation.prompt_logprobs))
            _extend(rendered, self._logprobs.completion(positions))
        return (text if echo is None else echo.text + text), rendered

    def opening_chunks(self) -> list[bytes]:
        return []

    def text_chunk(self, piece: Delta) -> bytes:
        return self._choice(piece.text, None, piece.logprobs)

    def final_chunk(self, piece: Final) -> bytes:
        return self._choice(piece.text, piece.finish_reason, piece.logprobs)

    def _choice(self, text: str, finish_reason: str | None, positions: Sequence[TokenLogprobs]) -> bytes:
        text, rendered = self._with_echo(text, positions)
        logprobs = b"null" if rendered is None else msgspec.json.encode(rendered)
        return self._prefix.choice(b"".join((b'{"index":0,"text":', text_json(text), b',"logprobs":', logprobs,
                                             b',"finish_reason":', finish_json(finish_reason), b"}")))

    def usage_chunk(self, usage: Usage) -> bytes:
        return self._prefix.usage(usage.model_dump_json().encode())

    def response(self, text: str, finish_reason: str, usage: Usage, logprobs: list[TokenLogprobs]) -> BaseModel:
        text, rendered = self._with_echo(text, logprobs)
        return CompletionResponse(id=self.request_id, model=self.model, created=self.created, usage=usage,
                                  choices=[CompletionChoice(text=text, finish_reason=finish_reason, logprobs=rendered)])


def _extend(rendered: dict[str, list[Any]], part: dict[str, list[Any]]) -> None:
    for key, values in part.items():
        rendered[key].extend(values)


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
        echo = None
        if body.echo:
            prompt = body.single_prompt
            prompt_ids = generation.params.prompt_ids
            echo = EchoedPrompt(prompt if isinstance(prompt, str) else context.tokenizer.decode(prompt_ids),
                                prompt_ids, generation)
        spelled = CompletionFormat(identity.request_id, body.model, int(time.time()), renderer, echo)
        return await respond(generation, spelled, stream=body.stream, include_usage=body.include_usage)

