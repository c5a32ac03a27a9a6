"""The router's FastAPI app: routes and the lifespan that wires the adapters together.

`create_app(config)` builds an app whose lifespan connects to NATS, mirrors the workers
(`WorkerPool`), and loads the router's own model's tokenizer from `config.model_dir` (the
other models' come from their workers' registrations: `served_models`). Routes stay thin: they
hand the parsed body to the endpoint's serving class. The state the lifespan builds lives
in a typed `RouterRuntime`, not in `app.state`.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.router.config import RouterConfig
from services.router.fleet.model_waker import ModelWaker
from services.router.fleet.worker_link import WorkerLink
from services.router.fleet.worker_pool import WorkerPool
from services.router.flows.dispatch import Dispatcher
from services.router.flows.records import Clock, RequestRecorder
from services.router.flows.responses_store import JetStreamResponseStore, MemoryResponseStore, ResponseStore
from services.router.http.auth.middleware import install_api_keys
from services.router.http.caller import caller_of
from services.router.http.generate_routes import GenerateRoutes
from services.router.http.input import InputGuard
from services.router.http.model_cards import model_list
from services.router.http.served_models import ServedModel, ServedModels
from services.router.http.serving import ServingContext, watched
from services.router.http.serving_chat import ChatServing
from services.router.http.serving_completions import CompletionsServing
from services.router.http.serving_responses import ResponsesServing
from services.router.http.serving_tokenize import TokenizeServing
from services.router.http.tokenize_routes import build_tokenize_routes
from services.router.http.tracing import TraceMiddleware
from services.router.kv.view import KvView
from services.router.metrics import RouterMetrics
from services.router.openai.errors import BadRequest, install_error_handlers
from services.router.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelList
from services.router.openai.protocol_responses import ResponsesRequest
from services.router.routing import build_policy
from services.router.routing.eligibility import can_serve
from services.router.routing.placement.placement import Placements
from shared.bus import Bus, connect
from shared.codec import MalformedCounter
from shared.config import ConfigError
from shared.request_plane import ResponseInbox
from shared.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Workers create the members bucket with this TTL as a floor (the orchestrator removes a
# silent worker much sooner); whoever creates the bucket first must use the same settings.

ENDPOINT_LABELS = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/responses": "responses"}


class _Started:
    """What exists only between lifespan start and stop."""

    def __init__(self, bus: Bus, pool: WorkerPool, context: ServingContext, response_store: ResponseStore) -> None:
        self.bus = bus
        self.pool = pool
        self.context = context
        self.completions = CompletionsServing(context)
        self.chat = ChatServing(context)
        self.responses = ResponsesServing(context, self.chat, response_store)
        self.tokenize = TokenizeServing(context)


class RouterRuntime:
    def __init__(self, config: RouterConfig, *, clock: Clock = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.policy = build_policy(config.routing)  # an unknown policy name fails here, at start
        self.malformed = MalformedCounter()
        self.metrics = RouterMetrics(self.malformed)
        self._started: _Started | None = None

    @property
    def started(self) -> _Started:
        assert self._started is not None, "the router's lifespan has not started"
        return self._started

    def count_rejected(self, path: str, outcome: str) -> None:
        self.metrics.requests.labels(ENDPOINT_LABELS.get(path, path), outcome).inc()

    async def _response_store(self, bus: Bus) -> ResponseStore:
        settings = self.config.responses
        if settings.store == "memory":
            return MemoryResponseStore(settings, self.clock)
        return await JetStreamResponseStore.open(bus, self.config.bus.subjects, settings)

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        config = self.config
        if not config.model_dir:
            raise ConfigError("the router needs a model directory (for its tokenizer)")
        tokenizer = Tokenizer.from_model_dir(config.model_dir)
        own_model = ServedModel(config.served_model_name or tokenizer.model_name, tokenizer)
        subjects = config.bus.subjects
        bus = await connect(config.bus, "tandem-router")
        kv_view = KvView(bus, subjects, self.malformed, verify_hashes=config.verify_kv_hashes,
                         tier_aware=config.routing.kv_tier_aware)
        placements = Placements(config.routing)  # the prefixes' homes, per model
        pool = WorkerPool(bus, subjects, self.malformed,
                          bucket_ttl_s=config.membership.bucket_ttl_s,
                          reconnect_grace_s=config.membership.ttl_s,  # one TTL to re-register after a restart
                          listeners=[kv_view, placements])
        inbox: ResponseInbox | None = None
        waker: ModelWaker | None = None
        try:
            await kv_view.start()
            await pool.start()
            self.metrics.watch_workers(lambda: len(pool))
            self.metrics.watch_pool(pool.views)
            self.metrics.watch_kv_index(kv_view.stats)
            self.metrics.in_flight.set_function(lambda: pool.in_flight)
            recorder = RequestRecorder(bus=bus, subjects=subjects, metrics=self.metrics, clock=self.clock)
            inbox = await ResponseInbox(bus).open()  # one subscription for every generate stream's frames
            # A lease release is a control round trip like an accept: bounded the same way.
            link = WorkerLink(bus, subjects, self.malformed, accept_timeout_s=config.accept_timeout_s,
                              idle_timeout_s=config.idle_timeout_s, lease_timeout_s=config.accept_timeout_s,
                              inbox=inbox)
            scalable = config.scale_from_zero.directories()
            catalog = ServedModels(own_model, pool, scalable)
            catalog.load_scalable()
            if scalable:  # a model with no worker gets one through the orchestrator
                waker = ModelWaker(bus, subjects, self.malformed, pool, timeout_s=config.scale_from_zero.hold_s,
                                   view_wait_s=config.scale_from_zero.view_wait_s)
            dispatcher = Dispatcher(link=link, pool=pool, kv_view=kv_view, placements=placements,
                                    decoders=lambda model: catalog.resolved(model).tokenizer, metrics=self.metrics,
                                    recorder=recorder, clock=self.clock, worker_wait_s=config.worker_wait_s,
                                    routing=config.routing, policy=self.policy,
                                    max_attempts=config.max_attempts, admission=config.admission,
                                    scale_from_zero=config.scale_from_zero, waker=waker)
            self.metrics.admission_waiting.set_function(dispatcher.admission.waiting)
            context = ServingContext(config=config, catalog=catalog, pool=pool,
                                     dispatcher=dispatcher, recorder=recorder, clock=self.clock)
            self._started = _Started(bus, pool, context, await self._response_store(bus))
            log.info("router serving %s; %d workers known", ", ".join(catalog.names()), len(pool))
            yield
        finally:
            self._started = None
            if waker is not None:
                await waker.stop()
            if inbox is not None:
                await inbox.close()
            await pool.stop()
            await kv_view.stop()
            await bus.close()


def build_routes(runtime: RouterRuntime) -> APIRouter:
    router = APIRouter()

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

    return router


def _no_framework_telemetry() -> dict:
    """FastAPI versions with telemetry of their own would add a second HTTP span (and one
    per dependency and endpoint) to every request: the router's `TraceMiddleware` is its
    HTTP span, whatever the FastAPI version."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}}


def create_app(config: RouterConfig) -> FastAPI:
    runtime = RouterRuntime(config)
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
