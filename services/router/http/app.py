"""The router's FastAPI app: routes, middleware, and a lifespan that serves the rooms below.

`create_app(config, assembly)` builds an app whose lifespan has the router's assembly
(`services.router.main.RouterAssembly`) build and start the rooms below `http/` (NATS, the
workers, the KV view, the flows) and hand back what the entrances serve from (`Rooms`): this
room wires none of them. Routes stay thin: they hand the parsed body to the endpoint's
serving class. What the lifespan started lives in a typed `RouterRuntime`, not in
`app.state`.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.router.config import RouterConfig
from services.router.http.auth.middleware import install_api_keys
from services.router.http.caller import caller_of
from services.router.http.generate_routes import GenerateRoutes
from services.router.http.input import InputGuard
from services.router.http.model_cards import model_list
from services.router.http.serving import ServingContext, watched
from services.router.http.serving_chat import ChatServing
from services.router.http.serving_completions import CompletionsServing
from services.router.http.serving_responses import ResponsesServing
from services.router.http.serving_tokenize import TokenizeServing
from services.router.http.tokenize_routes import build_tokenize_routes
from services.router.http.tracing import TraceMiddleware
from services.router.metrics import RouterMetrics
from services.router.openai.errors import BadRequest, install_error_handlers
from services.router.openai.protocol import ChatCompletionRequest, CompletionRequest
from services.router.openai.protocol_answers import ModelList
from services.router.openai.protocol_responses import ResponsesRequest
from services.router.routing.eligibility import can_serve
from shared.bus import Bus

if TYPE_CHECKING:  # a type only: the assembly builds the store
    from services.router.flows.responses_store import ResponseStore

log = logging.getLogger(__name__)

ENDPOINT_LABELS = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/responses": "responses"}


@dataclass(frozen=True)
class Rooms:
    """What the HTTP entrances serve from, built and started by the router's assembly."""

    bus: Bus  # its connection's state is the router's health
    context: ServingContext  # the served models, the workers, the dispatcher
    response_store: ResponseStore  # the stored responses of `/v1/responses`


class Assembly(Protocol):
    """The router's rooms below `http/`, wired (`services.router.main.RouterAssembly`)."""

    metrics: RouterMetrics
    clock: Callable[[], float]

    def start(self) -> AbstractAsyncContextManager[Rooms]:
        """Build and start the rooms; stop them on exit."""
        ...


class _Started:
    """What exists only between lifespan start and stop."""

    def __init__(self, rooms: Rooms) -> None:
        self.bus = rooms.bus
        self.pool = rooms.context.pool
        self.context = rooms.context
        self.completions = CompletionsServing(rooms.context)
        self.chat = ChatServing(rooms.context)
        self.responses = ResponsesServing(rooms.context, self.chat, rooms.response_store)
        self.tokenize = TokenizeServing(rooms.context)


class RouterRuntime:
    def __init__(self, config: RouterConfig, assembly: Assembly) -> None:
        self.config = config
        self.clock = assembly.clock
        self.metrics = assembly.metrics
        self._assembly = assembly
        self._started: _Started | None = None

    @property
    def started(self) -> _Started:
        assert self._started is not None, "the router's lifespan has not started"
        return self._started

    def count_rejected(self, path: str, outcome: str) -> None:
        self.metrics.requests.labels(ENDPOINT_LABELS.get(path, path), outcome).inc()

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        async with self._assembly.start() as rooms:
            self._started = _Started(rooms)
            try:
                yield
            finally:
                self._started = None


def build_routes(runtime: RouterRuntime) -> APIRouter:
    """The FastAPI routes: the generate endpoints (the bodies the fast path does not accept
    land here) and the router's status (`/v1/models`, `/health`, `/ready`, `/metrics`)."""
    router = APIRouter()
    _add_generate_routes(router, runtime)
    _add_status_routes(router, runtime)
    return router


def _add_generate_routes(router: APIRouter, runtime: RouterRuntime) -> None:
    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await watched(request.receive, runtime.started.completions.create(body, caller_of(request.scope)))

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await watched(request.receive, runtime.started.chat.create(body, caller_of(request.scope)))

    @router.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await watched(request.receive, runtime.started.responses.create(body, caller_of(request.scope)))

    @router.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, stream: bool = False, starting_after: int | None = None) -> Response:
        if stream or starting_after is not None:  # vLLM's replay of a background response's events
            raise BadRequest("streaming a stored response is not served: responses are never background ones",
                             param="stream" if stream else "starting_after")
        return await runtime.started.responses.retrieve(response_id)

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> Response:
        return await runtime.started.responses.cancel(response_id)


def _add_status_routes(router: APIRouter, runtime: RouterRuntime) -> None:
    @router.get("/v1/models")
    async def models() -> ModelList:
        return model_list(runtime.started.context)

    @router.get("/health")
    async def health() -> JSONResponse:
        started = runtime.started
        connected = started.bus.client.is_connected
        body = {"status": "ok" if connected else "unavailable",
                "nats": "connected" if connected else "disconnected",
                "worker_count": len(started.pool), "workers": started.pool.worker_ids,
                "in_flight": started.pool.in_flight}
        return JSONResponse(body, status_code=200 if connected else 503)

    @router.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness (liveness is /health): 503 until NATS is connected and an active worker that
        finishes requests (decode or both) serves the router's model."""
        started = runtime.started
        model = started.context.catalog.default.name
        serving = sorted(view.worker_id for view in started.pool.views() if can_serve(view, model))
        is_ready = started.bus.client.is_connected and bool(serving)
        body = {"status": "ready" if is_ready else "not ready", "model": model, "serving_workers": serving}
        return JSONResponse(body, status_code=200 if is_ready else 503)

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        body, content_type = runtime.metrics.exposition(request.headers.get("accept"))
        return Response(body, media_type=content_type)


def _no_framework_telemetry() -> dict:
    """FastAPI versions with telemetry of their own would add a second HTTP span (and one
    per dependency and endpoint) to every request: the router's `TraceMiddleware` is its
    HTTP span, whatever the FastAPI version."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}}


def create_app(config: RouterConfig, assembly: Assembly) -> FastAPI:
    runtime = RouterRuntime(config, assembly)
    app = FastAPI(title="Tandem router", lifespan=runtime.lifespan, **_no_framework_telemetry())
    install_error_handlers(app, on_rejected=runtime.count_rejected)
    app.include_router(build_routes(runtime))
    app.include_router(build_tokenize_routes(lambda: runtime.started.tokenize))
    # the generate endpoints' fast path; what it does not accept goes on to the routes above
    app.add_middleware(GenerateRoutes, completions=lambda: runtime.started.completions.create,
                       chat=lambda: runtime.started.chat.create)
    app.add_middleware(InputGuard)  # content type, body size and depth, before FastAPI parses a body
    install_api_keys(app, config, runtime.metrics, runtime.clock)  # API keys, before a body is read
    app.add_middleware(TraceMiddleware)  # around the error handlers: error answers carry the trace id too
    return app
