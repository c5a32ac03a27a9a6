"""What both generate endpoints share: model and limit checks, tokenization, and turning a
`Generation` into an HTTP answer (one JSON body, or an SSE stream), spelled by the
endpoint's format (`answer_format`).

The answer's status is decided only after the first piece of output (or the failure)
is known, so a request that fails before any byte is sent gets a proper error status;
once streaming, a failure is an SSE error event `data: {"error": {...}}` and the stream
ends without `[DONE]`, never a silently truncated success. A client that goes away
cancels the request on the worker (`watched`, `services.router.http.sse`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import msgspec
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.types import Receive

from services.router.config import RouterConfig
from services.router.fleet.worker_pool import WorkerPool
from services.router.flows.dispatch import Dispatcher
from services.router.flows.generation import Delta, Final, Generation
from services.router.flows.records import Clock, GenerationParams, RequestIdentity, RequestRecorder
from services.router.http.answer_format import ResponseFormat, WholeAnswer, api_usage
from services.router.http.caller import Caller
from services.router.http.image_fetch import ImageFetcher
from services.router.http.served_models import ServedModel, ServedModels
from services.router.http.sse import SSE_DONE, DisconnectWatch, SseResponse
from services.router.openai.errors import BadRequest, error_info
from services.router.openai.protocol import SamplingFields
from services.router.openai.protocol_answers import ErrorResponse
from shared.errors import ErrorCode, TandemError
from shared.schemas import SamplingParams, TokenLogprobs
from shared.schemas.generate import StructuredOutput
from shared.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Encoding this many characters takes long enough to be worth a thread hop.
TOKENIZE_IN_THREAD_CHARS = 16_384
OPENAI_DEFAULT_TEMPERATURE = 1.0


@dataclass
class ServingContext:
    """Everything the endpoints need, built once by the app's lifespan."""

    config: RouterConfig
    catalog: ServedModels  # each served model with its tokenizer
    pool: WorkerPool
    dispatcher: Dispatcher
    recorder: RequestRecorder
    clock: Clock

    def models(self) -> list[str]:
        return self.catalog.names()

    @functools.cached_property
    def image_fetcher(self) -> ImageFetcher:
        """Fetches the image URLs of the hosts `RouterConfig.image_url_hosts` allows."""
        return ImageFetcher(self.config.image_url_hosts, self.config.image_url_timeout_s)

    async def resolve_model(self, model: str) -> ServedModel:
        return await self.catalog.resolve(model)

    def tokenizer_of(self, model: str) -> Tokenizer:
        """The tokenizer of a model a request was resolved to (`resolve_model`)."""
        return self.catalog.resolved(model).tokenizer

    def max_tokens(self, requested: int | None, param: str) -> int:
        if requested is None:
            return min(self.config.default_max_tokens, self.config.max_tokens_limit)
        if requested < 1:
            raise BadRequest(f"{param} must be at least 1, got {requested}", param=param)
        if requested > self.config.max_tokens_limit:
            raise BadRequest(f"{param} must be at most {self.config.max_tokens_limit}, got {requested}",
                             param=param)
        return requested

    @staticmethod
    async def tokenize(tokenizer: Tokenizer, text: str) -> list[int]:
        if len(text) >= TOKENIZE_IN_THREAD_CHARS:
            return await asyncio.to_thread(tokenizer.encode, text)
        return tokenizer.encode(text)

    @classmethod
    async def prompt_ids(cls, tokenizer: Tokenizer, text: str, *, add_special_tokens: bool, chat: bool) -> list[int]:
        """A prompt's text as vLLM's server tokenizes it: the special token the model's tokenizer
        adds (BOS) only with `add_special_tokens` (a completion's default; a chat's template writes
        its own, so a BOS it writes and one added are one)."""
        token_ids = await cls.tokenize(tokenizer, text)  # with BOS when the model's tokenizer adds one
        if tokenizer.add_bos and not add_special_tokens:
            return token_ids[1:]  # the one BOS `encode` added; a BOS the text spells stays
        return without_double_bos(token_ids, tokenizer.bos_token_id) if chat else token_ids

    @staticmethod
    def check_prompt_ids(tokenizer: Tokenizer, prompt_ids: list[int], param: str) -> list[int]:
        if not prompt_ids:
            raise BadRequest("the prompt is empty", param=param)
        vocab_size = tokenizer.vocab_size
        out_of_range = [token for token in prompt_ids if not 0 <= token < vocab_size]
        if out_of_range:
            raise BadRequest(f"token ids must lie in [0, {vocab_size}), got {out_of_range[:5]}", param=param)
        return prompt_ids

    def params(self, identity: RequestIdentity, body: SamplingFields, model: ServedModel, prompt_ids: list[int],
               max_tokens: int, caller: Caller = Caller(), *, sample: int = 0) -> GenerationParams:
        """A validated request as the dispatcher takes it (both generate endpoints); the
        `sample`-th choice of its prompt samples with the seed + `sample`, as vLLM's server's."""
        sampling = sampling_params(body, max_tokens, model.tokenizer.vocab_size)
        if sample and sampling.seed is not None:
            sampling = msgspec.structs.replace(sampling, seed=sampling.seed + sample)
        return GenerationParams(request_id=identity.request_id, endpoint=identity.endpoint, model=model.name,
                                arrived_at=identity.arrived_at, prompt_ids=prompt_ids,
                                sampling=sampling, stop=body.stop_strings,
                                cache_hit_threshold=body.cache_hit_threshold,
                                include_stop_str=bool(body.include_stop_str_in_output), route_hint=caller.route_hint,
                                skip_special_tokens=body.skip_special_tokens,
                                eos_token_id=model.tokenizer.eos_token_id, tenant=caller.tenant(body.priority),
                                adapter=model.adapter, cache_salt=body.cache_salt or "")

    def identity(self, prefix: str, endpoint: str, model: str) -> RequestIdentity:
        return RequestIdentity(request_id=f"{prefix}-{uuid.uuid4().hex}", endpoint=endpoint, model=model,
                               arrived_at=self.clock())

    async def start(self, identity: RequestIdentity,
                    prepare: Callable[[], Awaitable[GenerationParams]]) -> Generation:
        """Validate (via `prepare`) and dispatch; a refusal is recorded before it is raised."""
        try:
            params = await prepare()
        except TandemError as error:
            await self.recorder.record(identity, outcome=error.code.value)
            raise
        except asyncio.CancelledError:
            await self.recorder.record(identity, outcome=ErrorCode.CANCELLED.value)
            raise
        return await self.dispatcher.dispatch(params)


def without_double_bos(token_ids: list[int], bos_token_id: int | None) -> list[int]:
    # A template that renders BOS itself, encoded by a tokenizer that adds BOS too, would
    # start with two; vLLM's server has one (it adds no special token to a rendered chat).
    if bos_token_id is not None and token_ids[:2] == [bos_token_id, bos_token_id]:
        return token_ids[1:]
    return token_ids


def sampling_params(body: SamplingFields, max_tokens: int, vocab_size: int) -> SamplingParams:
    """A request's sampling as the workers take it; token ids outside the vocabulary are a 400."""
    temperature = OPENAI_DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
    if body.min_tokens > max_tokens:
        raise BadRequest(f"min_tokens ({body.min_tokens}) must not exceed max_tokens ({max_tokens})",
                         param="min_tokens")
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, seed=body.seed,
        stop_token_ids=_vocabulary_ids(body.stop_token_ids, "stop_token_ids", vocab_size) or [],
        ignore_eos=body.ignore_eos,
        top_p=1.0 if body.top_p is None else body.top_p, top_k=max(0, body.top_k or 0),
        min_p=body.min_p or 0.0, presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        min_tokens=body.min_tokens, logit_bias=_logit_bias(body.logit_bias, vocab_size),
        bad_words=[word for word in body.bad_words or () if word],
        allowed_token_ids=_vocabulary_ids(body.allowed_token_ids, "allowed_token_ids", vocab_size),
        logprobs=body.logprobs_top, prompt_logprobs=body.prompt_logprobs_top, structured=structured_output(body))


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    if not bias:
        return {}
    try:
        token_ids = [int(key) for key in bias]
    except ValueError:
        raise BadRequest("logit_bias keys must be token ids (integers as strings)", param="logit_bias") from None
    _vocabulary_ids(token_ids, "logit_bias", vocab_size)
    return dict(zip(token_ids, bias.values(), strict=True))


def _vocabulary_ids(token_ids: list[int] | None, param: str, vocab_size: int) -> list[int] | None:
    """`token_ids` if each is one of the model's: vLLM's server refuses any other, negative ones
    too, with a 400 naming the field (`SamplingParams._validate_stop_token_ids`, `_validate_logit_bias`,
    `_validate_allowed_token_ids`), before its engine sees the request."""
    if token_ids is None:
        return None
    outside = [token for token in token_ids if not 0 <= token < vocab_size]
    if outside:
        raise BadRequest(f"token ids must lie in [0, {vocab_size}), got {outside[:5]}", param=param)
    return list(token_ids)


def structured_output(body: SamplingFields) -> StructuredOutput | None:
    """The form `response_format` or `structured_outputs` asks of the output (None: free text)."""
    form, wanted = body.response_format, body.structured_outputs
    if form is not None and form.type == "json_object":
        return StructuredOutput(json_object=True)
    if form is not None and form.json_schema is not None:
        return StructuredOutput(json_schema=json.dumps(form.json_schema.schema_))
    if wanted is None:
        return None
    schema = wanted.json_
    return StructuredOutput(json_schema=schema if isinstance(schema, str) or schema is None else json.dumps(schema),
                            json_object=bool(wanted.json_object), regex=wanted.regex, choice=wanted.choice,
                            grammar=wanted.grammar)


def sse(message: BaseModel) -> bytes:
    return f"data: {message.model_dump_json()}\n\n".encode()


async def whole_answer(generation: Generation, first: Delta | Final) -> WholeAnswer:
    """The rest of an answer after its `first` piece: its text, final piece, log-probabilities
    and tokens."""
    pieces: list[str] = []
    logprobs: list[TokenLogprobs] = []
    token_ids: list[int] = []
    piece = first
    while isinstance(piece, Delta):
        pieces.append(piece.text)
        logprobs.extend(piece.logprobs)
        token_ids.extend(piece.token_ids)
        piece = await generation.next()
    pieces.append(piece.text)
    logprobs.extend(piece.logprobs)
    token_ids.extend(piece.token_ids)
    return WholeAnswer("".join(pieces), piece, logprobs, token_ids)


async def respond(generation: Generation, response_format: ResponseFormat, *, stream: bool,
                  include_usage: bool) -> Response:
    try:
        first = await generation.next()  # a failure here is still a proper HTTP status
    except BaseException:
        await generation.close()
        raise
    if stream:
        return SseResponse(_events(generation, response_format, first, include_usage), generation.close)
    try:
        answer = await whole_answer(generation, first)
    finally:
        await generation.close()
    body = response_format.response(answer, api_usage(answer.final.usage))
    return Response(body.model_dump_json(), media_type="application/json")


async def _events(generation: Generation, response_format: ResponseFormat, first: Delta | Final,
                  include_usage: bool) -> AsyncIterator[tuple[bytes, bool]]:
    """`(chunk, last)`: the stream's end (final chunk, usage, `[DONE]`) is one last chunk."""
    opening = response_format.opening_chunks()
    piece = first
    try:
        while isinstance(piece, Delta):
            chunk = response_format.text_chunk(piece)  # empty: nothing to send yet (a tool call may begin)
            if opening:
                chunk, opening = b"".join((*opening, chunk)), []
            if chunk:
                yield chunk, False
            piece = await generation.next()
    except TandemError as error:
        yield sse(ErrorResponse(error=error_info(error))), True
        return
    except Exception as error:  # a bug: still end the stream with an explicit error
        log.exception("stream of %s failed", generation.params.request_id)
        yield sse(ErrorResponse(error=error_info(TandemError(f"internal error: {type(error).__name__}")))), True
        return
    tail = [*opening, response_format.final_chunk(piece)]
    if include_usage:
        tail.append(response_format.usage_chunk(api_usage(piece.usage)))
    tail.append(SSE_DONE)
    yield b"".join(tail), True


async def watched(receive: Receive, work: Awaitable[Response]) -> Response:
    """Run `work` in this task, cancelled if the client disconnects first (`receive` is the
    request's, its body already read); a streamed answer takes the watch over until its last
    byte (`SseResponse`)."""
    watch = DisconnectWatch(receive)
    try:
        response = await work
    except asyncio.CancelledError:
        watch.stop()
        if watch.absorb():
            return Response(status_code=499)  # the client is gone; nobody reads this
        raise
    except BaseException:
        watch.stop()
        raise
    if isinstance(response, SseResponse) and response.watch is None:
        response.watch = watch
    else:
        watch.stop()
    return response
