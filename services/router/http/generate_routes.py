"""The two generate endpoints' fast path (ASGI middleware, innermost of the router's own).

`POST /v1/completions` and `POST /v1/chat/completions` carry nearly all of the router's
traffic; through FastAPI each request crosses the framework's routing, dependency solving
and exception middleware, and each streamed chunk several `send` wrappers. Here the body
(already read and checked by `InputGuard`) is decoded with msgspec and validated by the same
pydantic model FastAPI would use, then handed to the same serving class. Whatever this path
does not accept as is (a body that does not decode or validate) goes on to FastAPI, replayed,
which answers it as before (its 400s and their counting stay in one place); a `TandemError`
becomes the same error answer as FastAPI's handler gives; any other exception propagates to
the outer error middleware, as from a route.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from services.router.http.caller import caller_of
from services.router.http.input import replay_body
from services.router.http.serving import watched
from services.router.openai.errors import tandem_error_response
from services.router.openai.protocol import ChatCompletionRequest, CompletionRequest
from shared.errors import TandemError

_decode_json = msgspec.json.Decoder().decode


class Endpoint:
    """One generate endpoint: its request model and the serving call (`create(body, caller)`)."""

    def __init__(self, model: type[BaseModel], create: Callable[[], Callable]) -> None:
        self.model = model
        self.create = create  # resolved per request: the serving object exists only while the lifespan runs


class GenerateRoutes:
    def __init__(self, app: ASGIApp, *, completions: Callable[[], Callable], chat: Callable[[], Callable]) -> None:
        self.app = app
        self._endpoints = {"/v1/completions": Endpoint(CompletionRequest, completions),
                           "/v1/chat/completions": Endpoint(ChatCompletionRequest, chat)}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self._endpoints.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        if body is None:
            return  # the client left before its body arrived
        try:
            request = endpoint.model.model_validate(_decode_json(body))
        except (msgspec.DecodeError, ValidationError):
            await self.app(scope, replay_body(body, receive), send)  # FastAPI answers it, as it always did
            return
        try:
            response: Response = await watched(receive, endpoint.create()(request, caller_of(scope)))
        except TandemError as error:
            response = tandem_error_response(error)
        await response(scope, receive, send)


async def _read_body(receive: Receive) -> bytes | None:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)
