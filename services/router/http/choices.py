"""An answer of several choices: `n` per prompt, for each prompt of a batch, as vLLM's server
gives them. Each choice is a `Generation` of its own (routed on its own, resumed on its own);
choice `prompt_index * n + i` is the i-th of that prompt's.

- Whole: every choice's text, in index order, and one usage: the prompt tokens of each prompt
  once, the completion tokens of every choice.
- Streamed: each choice's chunks carry its index, in the order they arrive (a chat stream
  opens with each choice's role chunk); then, with `include_usage`, the usage chunk and
  `[DONE]`.
The status is decided once every choice has its first piece: a choice refused or failed
before any byte is the request's error. After that, a failing choice ends the stream with an
SSE error event, and the other choices are cancelled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi.responses import Response
from pydantic import BaseModel

from services.router.flows.generation import Delta, Final, Generation
from services.router.flows.records import RequestIdentity, TokenUsage
from services.router.http.answer_format import ResponseFormat, WholeAnswer, api_usage
from services.router.http.serving import respond, sse, whole_answer
from services.router.http.sse import SSE_DONE, SseResponse
from services.router.openai.errors import error_info
from services.router.openai.protocol_answers import ErrorResponse, Usage
from shared.errors import TandemError

log = logging.getLogger(__name__)


class ChoiceFormat(ResponseFormat, Protocol):
    def choice(self, answer: WholeAnswer) -> Any: ...
    def response_of(self, choices: list[Any], usage: Usage) -> BaseModel: ...


@dataclass
class Choice:
    generation: Generation
    spelled: ChoiceFormat  # its index's format
    prompt_index: int


def total_usage(choices: Sequence[Choice], finals: Sequence[Final]) -> Usage:
    """Each prompt's tokens once (its first choice's count), every choice's completion tokens."""
    prompts: dict[int, TokenUsage] = {}
    for choice, final in zip(choices, finals, strict=True):
        prompts.setdefault(choice.prompt_index, final.usage)
    return api_usage(TokenUsage(prompt_tokens=sum(usage.prompt_tokens for usage in prompts.values()),
                                completion_tokens=sum(final.usage.completion_tokens for final in finals),
                                cached_tokens=sum(usage.cached_tokens for usage in prompts.values())))


async def answer_choices(identity: RequestIdentity, count: int,
                         start: Callable[[RequestIdentity, int], Awaitable[Choice]], *, stream: bool,
                         include_usage: bool) -> Response:
    """The answer of `count` choices, each started by `start` (`ChatServing`, `CompletionsServing`):
    one under the request's own id, answered as a single generation; several through
    `start_choices`, each under its own."""
    if count == 1:
        choice = await start(identity, 0)
        return await respond(choice.generation, choice.spelled, stream=stream, include_usage=include_usage)
    choices = await start_choices(identity, count, start)
    return await respond_choices(choices, stream=stream, include_usage=include_usage)


async def start_choices(identity: RequestIdentity, count: int,
                        start: Callable[[RequestIdentity, int], Awaitable[Choice]]) -> list[Choice]:
    """`count` choices, the i-th started by `start` under its own request id (`<id>-<i>`); when
    one cannot start, those already started are closed and its failure raised."""
    choices: list[Choice] = []
    try:
        for index in range(count):
            choices.append(await start(dataclasses.replace(identity, request_id=f"{identity.request_id}-{index}"),
                                       index))
    except BaseException:
        await close_all(choices)
        raise
    return choices


async def respond_choices(choices: list[Choice], *, stream: bool, include_usage: bool) -> Response:
    try:
        firsts = await asyncio.gather(*(choice.generation.next() for choice in choices))
    except BaseException:
        await close_all(choices)
        raise
    if stream:
        return SseResponse(_events(choices, list(firsts), include_usage), lambda: close_all(choices))
    try:
        answers = await asyncio.gather(*(whole_answer(choice.generation, first)
                                         for choice, first in zip(choices, firsts, strict=True)))
    finally:
        await close_all(choices)
    spelled = [choice.spelled.choice(answer) for choice, answer in zip(choices, answers, strict=True)]
    body = choices[0].spelled.response_of(spelled, total_usage(choices, [answer.final for answer in answers]))
    return Response(body.model_dump_json(), media_type="application/json")


async def close_all(choices: Sequence[Choice]) -> None:
    await asyncio.gather(*(choice.generation.close() for choice in choices), return_exceptions=True)


async def _pieces(choice: Choice, first: Delta | Final, queue: asyncio.Queue) -> None:
    """Every piece of one choice into `queue` as (choice, piece or error), its final one last."""
    piece: Delta | Final = first
    try:
        while True:
            await queue.put((choice, piece))
            if isinstance(piece, Final):
                return
            piece = await choice.generation.next()
    except TandemError as error:
        await queue.put((choice, error))
    except Exception as error:  # a bug: still an explicit error for the client
        log.exception("a choice of %s failed", choice.generation.params.request_id)
        await queue.put((choice, TandemError(f"internal error: {type(error).__name__}")))


async def _events(choices: list[Choice], firsts: list[Delta | Final],
                  include_usage: bool) -> AsyncIterator[tuple[bytes, bool]]:
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_pieces(choice, first, queue)) for choice, first in zip(choices, firsts, strict=True)]
    finals: dict[int, Final] = {}
    opening = [chunk for choice in choices for chunk in choice.spelled.opening_chunks()]
    try:
        while len(finals) < len(choices):
            choice, piece = await queue.get()
            if isinstance(piece, TandemError):
                yield sse(ErrorResponse(error=error_info(piece))), True
                return
            if isinstance(piece, Final):
                finals[choices.index(choice)] = piece
                chunk = choice.spelled.final_chunk(piece)
            else:
                chunk = choice.spelled.text_chunk(piece)
            if opening:
                chunk, opening = b"".join((*opening, chunk)), []
            yield chunk, False
        tail = []
        if include_usage:
            ordered = [finals[index] for index in range(len(choices))]
            tail.append(choices[0].spelled.usage_chunk(total_usage(choices, ordered)))
        tail.append(SSE_DONE)
        yield b"".join(tail), True
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
