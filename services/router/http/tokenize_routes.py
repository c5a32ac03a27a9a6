"""The routes `POST /tokenize` and `POST /detokenize` (vLLM's, outside `/v1` as there).

A `/tokenize` body is a completion prompt or a chat, told apart by `messages` as vLLM's
union of the two models does; it is validated here against the one it is, so that a
refusal names the field as the generate endpoints' do (a pydantic union would prefix
every field with the member's name). Both routes are guarded by the router's API keys
like `/v1/*` (`services.router.http.auth.middleware`); the work is `TokenizeServing`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Body
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from services.router.http.serving_tokenize import TokenizeServing
from services.router.openai.errors import BadRequest
from services.router.openai.protocol_tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeRequest,
    TokenizeResponse,
)

TOKENIZE_PATHS = ("/tokenize", "/detokenize")


def tokenize_request(body: dict[str, Any]) -> TokenizeRequest:
    """The request `body` is: a chat when it has `messages`, else a completion prompt."""
    if "messages" in body and "prompt" in body:
        raise BadRequest("send either prompt or messages, not both", param="messages")
    model = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
    try:
        return model.model_validate(body)
    except ValidationError as error:  # answered like FastAPI's own validation of a body
        raise RequestValidationError([{**detail, "loc": ("body", *detail["loc"])}
                                      for detail in error.errors(include_url=False)]) from None


def build_tokenize_routes(serving: Callable[[], TokenizeServing]) -> APIRouter:
    """`serving()` is resolved per request: it exists only while the app's lifespan runs."""
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize(body: dict[str, Any] = Body()) -> TokenizeResponse:
        return await serving().tokenize(tokenize_request(body))

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return await serving().detokenize(body)

    return router
