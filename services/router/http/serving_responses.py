"""`/v1/responses`: OpenAI's Responses API on the chat path.

A request is translated into the chat request the router already serves
(`openai.responses_translation`) and started by the chat serving (`ChatServing.start_one`):
the same routing, tokenization, tool calling and structured output. Its answer is spelled as
a response object, or streamed as the Responses API's events (`openai.responses_events`).
A stored response (`store`, the default) is kept in the `ResponseStore` once it is done; a
response is stored only when finished, so `cancel` of a stored one is a 400 as vLLM's server
answers a synchronous one, and an id never stored (or expired) is a 404.

As with chats, the status is decided once the first piece of output (or the failure) is
known; once streaming, a failure is an `error` event and the stream ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from fastapi.responses import Response

from services.router.flows.generation import Delta, Final, Generation
from services.router.flows.records import RequestIdentity, TokenUsage
from services.router.flows.responses_store import ResponseStore
from services.router.http.caller import Caller
from services.router.http.serving import ServingContext, whole_answer
from services.router.http.serving_chat import ChatServing
from services.router.http.sse import SseResponse
from services.router.openai.errors import BadRequest, ResponseNotFound, error_info
from services.router.openai.protocol_messages import ChatMessage
from services.router.openai.protocol_responses import ResponsesRequestBase
from services.router.openai.responses_events import ResponseEvents
from services.router.openai.responses_objects import ResponseObject, ResponseUsage, StoredResponse
from services.router.openai.responses_translation import ResponseDraft, chat_request, conversation, usage_of
from services.router.openai.tool_calls import ToolCalling, ToolStream
from shared.errors import TandemError

log = logging.getLogger(__name__)

ENDPOINT = "responses"
JSON = "application/json"


def _usage(usage: TokenUsage) -> ResponseUsage:
    return usage_of(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)


class ResponsesServing:
    def __init__(self, context: ServingContext, chat: ChatServing, store: ResponseStore) -> None:
        self._context = context
        self._chat = chat
        self._store = store

    async def create(self, body: ResponsesRequestBase, caller: Caller = Caller()) -> Response:
        context = self._context
        previous = None
        if body.previous_response_id is not None:
            previous = await self._stored(body.previous_response_id, "previous_response_id")
        model = body.model or context.catalog.default.name
        max_tokens = context.max_tokens(body.max_output_tokens, "max_output_tokens")
        turn = conversation(body.input, previous)
        chat = chat_request(body, model, max_tokens, turn)
        draft = ResponseDraft(body, model, int(time.time()), max_tokens)
        identity = RequestIdentity(request_id=draft.response_id, endpoint=ENDPOINT, model=model,
                                   arrived_at=context.clock())
        try:
            generation, calling = await self._chat.start_one(identity, chat, caller)
        except BadRequest as error:
            if error.param is not None and error.param.startswith("messages"):
                error.param = "input"  # the chat's messages are this request's input (after a stored turn's)
            elif error.param == "truncate_prompt_tokens":
                error.param = "truncation"
            raise
        try:
            first = await generation.next()  # a failure here is still a proper HTTP status
        except BaseException:
            await generation.close()
            raise
        if body.stream:
            return SseResponse(self._events(generation, first, calling, draft, turn), generation.close)
        try:
            answer = await whole_answer(generation, first)
        finally:
            await generation.close()
        text, final = answer.text, answer.final
        content, calls, finish_reason = text, [], final.finish_reason
        if calling is not None:
            answer = calling.answer(text, final.finish_reason)
            content, calls, finish_reason = answer.content, answer.calls, answer.finish_reason
        response = draft.finished(content, calls, finish_reason, _usage(final.usage))
        await self._keep(response, turn)
        return Response(response.model_dump_json(by_alias=True), media_type=JSON)

    async def retrieve(self, response_id: str) -> Response:
        stored = await self._stored(response_id, "response_id")
        return Response(stored.response.model_dump_json(by_alias=True), media_type=JSON)

    async def cancel(self, response_id: str) -> Response:
        await self._stored(response_id, "response_id")
        # only a finished response is ever stored (background is refused): nothing runs to cancel
        raise BadRequest("Cannot cancel a synchronous response.", param="response_id")

    async def _stored(self, response_id: str, param: str) -> StoredResponse:
        stored = await self._store.get(response_id)
        if stored is None:
            raise ResponseNotFound(response_id, param=param)
        return stored

    async def _keep(self, response: ResponseObject, turn: list[ChatMessage]) -> None:
        """Store a finished response when its request asked (the answer goes out even if the
        store fails: the client has paid for it)."""
        if not response.store:
            return
        try:
            await self._store.put(StoredResponse(response=response, conversation=turn))
        except Exception:
            log.exception("response %s could not be stored", response.id)

    async def _events(self, generation: Generation, first: Delta | Final, calling: ToolCalling | None,
                      draft: ResponseDraft, turn: list[ChatMessage]) -> AsyncIterator[tuple[bytes, bool]]:
        """`(chunk, last)`: the events of one streamed response (`openai.responses_events`)."""
        events = ResponseEvents(draft.message_id)
        tool_stream = ToolStream(calling) if calling is not None else None
        opening = events.opening(draft.in_progress())
        piece = first
        try:
            while isinstance(piece, Delta):
                text = piece.text if tool_stream is None else tool_stream.add(piece.text)
                chunk, opening = opening + events.text_delta(text), b""
                if chunk:
                    yield chunk, False
                piece = await generation.next()
            calls, finish_reason, rest = [], piece.finish_reason, piece.text
            if tool_stream is not None:
                rest, answer = tool_stream.finish(piece.text, piece.finish_reason)
                calls, finish_reason = answer.calls, answer.finish_reason
            closing = opening + events.text_delta(rest)
            response = draft.finished(events.text, calls, finish_reason, _usage(piece.usage))
        except TandemError as error:
            info = error_info(error)
            yield opening + events.error(info.code, info.message, info.param), True
            return
        except Exception as error:  # a bug: still end the stream with an explicit error
            log.exception("stream of %s failed", draft.response_id)
            yield opening + events.error("internal", f"internal error: {type(error).__name__}", None), True
            return
        await self._keep(response, turn)
        yield closing + events.closing(response), True
