"""`/v1/completions`: a prompt (text or token ids) in, generated text out.

With `echo`, the answer starts with the prompt (its text as sent, or the decoding of its
token ids), and with `logprobs` too, with the prompt tokens' log-probabilities (the first
has none), which the worker that computed the prompt sends with the first token."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi.responses import Response

from services.router.flows.generation import Delta, Final, Generation
from services.router.flows.records import GenerationParams, RequestIdentity
from services.router.http.answer_format import EndpointFormat, WholeAnswer, prompt_logprobs_of, usage_so_far
from services.router.http.caller import Caller
from services.router.http.choices import Choice, answer_choices
from services.router.http.prompt_truncation import truncate_prompt
from services.router.http.serving import ServingContext
from services.router.http.sse import UsageSoFar, finish_json, ids_member, text_json
from services.router.openai.logprobs import LogprobsRenderer
from services.router.openai.prompt_logprobs import PromptLogprobs
from services.router.openai.protocol import CompletionRequest
from services.router.openai.protocol_answers import CompletionChoice, CompletionResponse
from shared.schemas import TokenLogprobs

ENDPOINT = "completions"


@dataclass
class EchoedPrompt:
    text: str
    token_ids: list[int]
    generation: Generation  # its `prompt_logprobs` are known once its first piece is


class CompletionFormat(EndpointFormat):
    chunk_object = "text_completion"
    answer_type = CompletionResponse

    def __init__(self, request_id: str, model: str, created: int, logprobs: LogprobsRenderer | None = None,
                 echo: EchoedPrompt | None = None, index: int = 0, usage_so_far: UsageSoFar | None = None,
                 prompt_token_ids: list[int] | None = None,
                 prompt_logprobs: Callable[[], PromptLogprobs] | None = None) -> None:
        super().__init__(request_id, model, created, logprobs, index, usage_so_far, prompt_token_ids)
        self._prompt_logprobs = prompt_logprobs  # vLLM's, rendered once the answer is whole
        self._echo = echo  # until the first piece is spelled
        self._prompt_ids_sent = False  # a stream's first chunk of this choice carries them

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
        return self._choice(piece.text, None, piece.logprobs, piece.completion_tokens, piece.token_ids)

    def final_chunk(self, piece: Final) -> bytes:
        return self._choice(piece.text, piece.finish_reason, piece.logprobs, piece.usage.completion_tokens,
                            piece.token_ids)

    def _choice(self, text: str, finish_reason: str | None, positions: Sequence[TokenLogprobs],
                completion_tokens: int, token_ids: Sequence[int]) -> bytes:
        # a choice's first chunk names the prompt's ids when asked, and (as vLLM's server
        # streams it) whenever it echoes the prompt
        prompt = self.prompt_token_ids if self.prompt_token_ids is not None or self._echo is None else \
            self._echo.token_ids
        text, rendered = self._with_echo(text, positions)
        logprobs = b"null" if rendered is None else msgspec.json.encode(rendered)
        prompt_ids = b""
        if prompt is not None and not self._prompt_ids_sent:
            prompt_ids, self._prompt_ids_sent = ids_member("prompt_token_ids", prompt), True
        return self.choice_chunk(b"".join((self._index_json, b',"text":', text_json(text), b',"logprobs":', logprobs,
                                           b',"finish_reason":', finish_json(finish_reason), prompt_ids,
                                           self.ids_json(token_ids), b"}")), completion_tokens)

    def choice(self, answer: WholeAnswer) -> CompletionChoice:
        text, rendered = self._with_echo(answer.text, answer.logprobs)
        return CompletionChoice(index=self.index, text=text, finish_reason=answer.final.finish_reason,
                                logprobs=rendered, prompt_token_ids=self.prompt_token_ids,
                                token_ids=answer.token_ids if self.prompt_token_ids is not None else None,
                                prompt_logprobs=self._prompt_logprobs() if self._prompt_logprobs else None)


def _extend(rendered: dict[str, list[Any]], part: dict[str, list[Any]]) -> None:
    for key, values in part.items():
        rendered[key].extend(values)


class CompletionsServing:
    def __init__(self, context: ServingContext) -> None:
        self._context = context

    async def create(self, body: CompletionRequest, caller: Caller = Caller()) -> Response:
        context = self._context
        identity = context.identity("cmpl", ENDPOINT, body.model)
        created = int(time.time())
        prompts = body.prompts

        async def start(own: RequestIdentity, index: int) -> Choice:  # the prompts' choices in turn, n each
            prompt_index, sample = divmod(index, body.n)
            prompt = prompts[prompt_index]
            generation = await context.start(own, self._prepare(own, body, prompt, sample, caller))
            return Choice(generation, self._format(identity.request_id, body, created, prompt, generation, index),
                          prompt_index)

        return await answer_choices(identity, len(prompts) * body.n, start, stream=body.stream,
                                    include_usage=body.include_usage)

    def _prepare(self, identity: RequestIdentity, body: CompletionRequest, prompt: str | list[int], sample: int,
                 caller: Caller) -> Callable[[], Awaitable[GenerationParams]]:
        """The validation of one choice's request: the `sample`-th of its prompt's (seed + sample)."""
        context = self._context

        async def prepare() -> GenerationParams:
            model = await context.resolve_model(body.model)
            tokenizer = model.tokenizer
            prompt_ids = await context.prompt_ids(tokenizer, prompt, add_special_tokens=body.add_special_tokens,
                                                  chat=False) if isinstance(prompt, str) else list(prompt)
            prompt_ids = truncate_prompt(context, body, model.name, prompt_ids, asks_output=True,
                                         added_bos=isinstance(prompt, str) and tokenizer.add_bos
                                         and body.add_special_tokens)
            prompt_ids = context.check_prompt_ids(tokenizer, prompt_ids, "prompt")
            max_tokens = context.max_tokens(body.max_tokens, "max_tokens")
            return context.params(identity, body, model, prompt_ids, max_tokens, caller, sample=sample)

        return prepare

    def _format(self, request_id: str, body: CompletionRequest, created: int, prompt: str | list[int],
                generation: Generation, index: int) -> CompletionFormat:
        tokenizer = self._context.tokenizer_of(generation.params.model)
        renderer = None if body.logprobs_top is None else LogprobsRenderer(
            tokenizer, body.logprobs_top, as_token_ids=bool(body.return_tokens_as_token_ids))
        echo = None
        prompt_ids = generation.params.prompt_ids
        if body.echo:  # with return_token_ids, vLLM's server echoes the prompt's ids, not its text; the
            # prompt as sent, whole, even where truncate_prompt_tokens served its end
            text = "" if body.return_token_ids else prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
            echo = EchoedPrompt(text, prompt_ids, generation)
        return CompletionFormat(request_id, body.model, created, renderer, echo, index, usage_so_far(body, generation),
                                prompt_ids if body.return_token_ids else None,
                                prompt_logprobs_of(generation, tokenizer, body.prompt_logprobs_top, clamp=False))

