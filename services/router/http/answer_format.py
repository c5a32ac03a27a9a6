"""How the completions and chat endpoints spell one choice's answer: whole (a model), or
streamed (SSE chunks as bytes, `services.router.http.sse`), and the usage it reports.
`serving.respond` drives a format over a `Generation`; `serving_completions` and
`serving_chat` subclass `EndpointFormat`; `choices` joins several choices' answers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from pydantic import BaseModel

from services.router.flows.generation import Delta, Final, Generation
from services.router.flows.records import TokenUsage
from services.router.http.sse import ChunkPrefix, UsageSoFar, ids_member
from services.router.openai.logprobs import LogprobsRenderer, SpecialTokenDecoder
from services.router.openai.prompt_logprobs import PromptLogprobs, prompt_logprobs
from services.router.openai.protocol import SamplingFields
from services.router.openai.protocol_answers import PromptTokensDetails, Usage
from shared.schemas import TokenLogprobs


class ResponseFormat(Protocol):
    """How one endpoint spells its answer: whole (a model), or streamed (SSE chunks as bytes,
    `services.router.http.sse`)."""

    def opening_chunks(self) -> list[bytes]: ...
    def text_chunk(self, piece: Delta) -> bytes: ...
    def final_chunk(self, piece: Final) -> bytes: ...
    def usage_chunk(self, usage: Usage) -> bytes: ...
    def response(self, answer: WholeAnswer, usage: Usage) -> BaseModel: ...


@dataclass(frozen=True)
class WholeAnswer:
    """A generation's answer read to its end (`whole_answer`)."""

    text: str
    final: Final
    logprobs: list[TokenLogprobs]
    token_ids: list[int]  # every generated token the usage counts (vLLM's `return_token_ids`)


class EndpointFormat:
    """What the completions and chat formats share for one choice of one request: its SSE
    chunks' common prefix (`chunk_object`), each chunk's own usage when asked (`usage_so_far`),
    its usage chunk, and its whole answer (`answer_type`) around the choice a subclass spells
    (`choice`)."""

    chunk_object: ClassVar[str]
    answer_type: ClassVar[type[BaseModel]]

    def __init__(self, request_id: str, model: str, created: int, logprobs: LogprobsRenderer | None,
                 index: int, usage_so_far: UsageSoFar | None = None, prompt_token_ids: list[int] | None = None) -> None:
        self.index = index  # the choice's
        self._index_json = b'{"index":' + str(index).encode()
        self.request_id = request_id
        self.model = model
        self.created = created
        self._prefix = ChunkPrefix(request_id, self.chunk_object, created, model)
        self._logprobs = logprobs
        self._usage_so_far = usage_so_far  # None: the chunks carry no usage ("usage": null)
        self.prompt_token_ids = prompt_token_ids  # vLLM's `return_token_ids`: None when not asked
        self._unsent_ids: list[int] = []  # generated tokens whose text a chunk still holds back

    def choice_chunk(self, choice_json: bytes, completion_tokens: int, extra_json: bytes = b"") -> bytes:
        """A chunk of this choice, sent once it has generated `completion_tokens`; `extra_json`:
        more top-level members."""
        usage = b"null" if self._usage_so_far is None else self._usage_so_far.json(completion_tokens)
        return self._prefix.choice(choice_json, usage, extra_json)

    def hold_ids(self, token_ids: Sequence[int]) -> None:
        """A piece's tokens whose text is held back: the next chunk sends them."""
        if self.prompt_token_ids is not None:
            self._unsent_ids.extend(token_ids)

    def ids_json(self, token_ids: Sequence[int]) -> bytes:
        """`,"token_ids":[...]` for a chunk of `token_ids` (and those held back before); b""
        when the request did not ask for them."""
        if self.prompt_token_ids is None:
            return b""
        ids, self._unsent_ids = [*self._unsent_ids, *token_ids], []
        return ids_member("token_ids", ids)

    def usage_chunk(self, usage: Usage) -> bytes:
        return self._prefix.usage(usage.model_dump_json().encode())

    def choice(self, answer: WholeAnswer) -> BaseModel:
        raise NotImplementedError

    def response_of(self, choices: list[Any], usage: Usage) -> BaseModel:
        return self.answer_type(id=self.request_id, model=self.model, created=self.created, usage=usage,
                                choices=choices, **self.answer_members())

    def answer_members(self) -> dict[str, Any]:
        """The whole answer's own members beside its choices (an endpoint's extensions)."""
        return {}

    def response(self, answer: WholeAnswer, usage: Usage) -> BaseModel:
        return self.response_of([self.choice(answer)], usage)


def prompt_logprobs_of(generation: Generation, decoder: SpecialTokenDecoder, top: int | None, *,
                       clamp: bool) -> Callable[[], PromptLogprobs] | None:
    """vLLM's `prompt_logprobs` of a whole answer, where the request had them computed (`top`:
    how many top ones per token; None: not computed)."""
    if top is None:
        return None
    return lambda: prompt_logprobs(generation.prompt_logprobs or (), decoder, top, clamp=clamp)


def usage_so_far(body: SamplingFields, generation: Generation) -> UsageSoFar | None:
    """The usage a choice's chunks carry (`stream_options.continuous_usage_stats`), or None."""
    return UsageSoFar(len(generation.params.prompt_ids)) if body.continuous_usage else None


def api_usage(usage: TokenUsage) -> Usage:
    return Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                 total_tokens=usage.prompt_tokens + usage.completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens))
