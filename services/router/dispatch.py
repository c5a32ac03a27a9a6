"""Routing a request to a worker and opening its stream (adapter around `policy`).

A request waits up to `worker_wait_s` (from its arrival) for a worker that can take it.
A worker that refuses before producing anything (`Unavailable`: nobody listening, no
accept in time, or draining) costs the client nothing, so the request is re-routed to
another worker, a bounded number of times. Every refusal that reaches the client is
recorded here; once a `Generation` is returned, it records its own outcome.
"""

from __future__ import annotations

import asyncio
import logging

from opentelemetry import trace

from services.router.detokenizer import TokenDecoder
from services.router.errors import BadRequest
from services.router.generation import Generation
from services.router.metrics import RouterMetrics
from services.router.policy import RouteRequest, choose_worker, context_limit
from services.router.records import Clock, GenerationParams, RequestRecorder, TokenUsage
from services.router.worker_pool import InFlight, WorkerPool
from shared.bus import Bus
from shared.errors import ErrorCode, TandemError, Unavailable
from shared.request_plane import open_stream
from shared.schemas import GenerateRequest
from shared.subjects import Subjects
from shared.tracing import inject_headers

log = logging.getLogger(__name__)
tracer = trace.get_tracer("tandem.router")

MAX_ATTEMPTS = 3  # workers tried per request when they refuse it


def _outcome(error: BaseException) -> str:
    if isinstance(error, TandemError):
        return error.code.value
    if isinstance(error, asyncio.CancelledError):
        return ErrorCode.CANCELLED.value
    return ErrorCode.UNAVAILABLE.value


class Dispatcher:
    def __init__(self, *, bus: Bus, subjects: Subjects, pool: WorkerPool, decoder: TokenDecoder,
                 metrics: RouterMetrics, recorder: RequestRecorder, clock: Clock, worker_wait_s: float,
                 accept_timeout_s: float, idle_timeout_s: float) -> None:
        self._bus = bus
        self._subjects = subjects
        self._pool = pool
        self._decoder = decoder
        self._metrics = metrics
        self._recorder = recorder
        self._clock = clock
        self._worker_wait_s = worker_wait_s
        self._accept_timeout_s = accept_timeout_s
        self._idle_timeout_s = idle_timeout_s

    async def dispatch(self, params: GenerationParams) -> Generation:
        """A generation whose worker has produced its first output; raises `TandemError`."""
        refused_by: set[str] = set()
        deadline = params.arrived_at + self._worker_wait_s
        while True:
            try:
                in_flight = await self._route(params, refused_by, deadline)
            except (TandemError, asyncio.CancelledError) as error:
                await self._recorder.record(params, outcome=_outcome(error),
                                            usage=TokenUsage(len(params.prompt_ids), 0, 0))
                raise
            generation = await self._open(params, in_flight)
            try:
                await generation.prime()
            except Unavailable as error:
                refused_by.add(in_flight.worker_id)
                if len(refused_by) >= MAX_ATTEMPTS:
                    await generation.close()
                    raise
                log.info("worker %s refused %s (%s); re-routing", in_flight.worker_id, params.request_id, error)
                await generation.close(record=False)
                continue
            except BaseException:
                await generation.close()
                raise
            return generation

    async def _open(self, params: GenerationParams, in_flight: InFlight) -> Generation:
        span = tracer.start_span("router.generate", attributes={
            "tandem.request_id": params.request_id, "tandem.worker_id": in_flight.worker_id,
            "tandem.prompt_tokens": len(params.prompt_ids), "tandem.max_tokens": params.sampling.max_tokens})
        with trace.use_span(span, end_on_exit=False):
            headers = inject_headers()
        request = GenerateRequest(request_id=params.request_id, model=params.model, token_ids=params.prompt_ids,
                                  sampling=params.sampling)
        try:
            stream = await open_stream(self._bus, self._subjects.generate(in_flight.worker_id), request,
                                       headers=headers, accept_timeout_s=self._accept_timeout_s,
                                       idle_timeout_s=self._idle_timeout_s)
        except BaseException as error:  # NATS is down (nothing was sent), or the client left
            in_flight.end()
            span.end()
            await self._recorder.record(params, outcome=_outcome(error), worker_id=in_flight.worker_id,
                                        usage=TokenUsage(len(params.prompt_ids), 0, 0))
            if isinstance(error, Exception):
                raise Unavailable(f"could not send the request to {in_flight.worker_id}: {error}") from error
            raise
        in_flight.attach(stream)
        return Generation(params=params, in_flight=in_flight, stream=stream, decoder=self._decoder,
                          bus=self._bus, subjects=self._subjects, metrics=self._metrics,
                          recorder=self._recorder, clock=self._clock, span=span)

    async def _route(self, params: GenerationParams, refused_by: set[str], deadline: float) -> InFlight:
        route = RouteRequest(model=params.model, total_tokens=len(params.prompt_ids) + params.sampling.max_tokens)
        while True:
            views = [view for view in self._pool.views() if view.worker_id not in refused_by]
            worker_id = choose_worker(views, route)
            if worker_id is not None:
                # no await between choosing and counting: concurrent requests see this one
                return self._pool.begin(worker_id, params.request_id)
            limit = context_limit(views, params.model)
            if limit is not None and route.total_tokens > limit:
                raise BadRequest(
                    f"This model's maximum context length is {limit} tokens. However, you requested "
                    f"{route.total_tokens} tokens ({len(params.prompt_ids)} in the prompt, "
                    f"{params.sampling.max_tokens} for the completion). Please reduce the prompt or max_tokens.",
                    param="max_tokens", api_code="context_length_exceeded")
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise Unavailable(f"no worker is available for model {params.model!r} "
                                  f"(waited {self._worker_wait_s:g}s)")
            await self._pool.wait_for_change(remaining)
