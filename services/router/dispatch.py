"""Routing a request to its worker(s) and opening its token source (adapter around `policy`).

The policy's `RouteDecision` picks the flow: one worker (single) or a prefill worker then
a decode worker (disaggregated, `services.router.disaggregated`). Every worker of the
decision is counted in flight (`WorkerPool.begin`) right when it is chosen, with no
await in between, so concurrent requests see each other; the decode worker of a
disaggregated request is counted from routing on, while its prompt is computed elsewhere.

A request waits up to `worker_wait_s` (from its arrival) for a worker that can take it.
A worker that refuses before producing anything (`Unavailable`: nobody listening, no
accept in time, or draining) costs the client nothing, so the request is re-routed to
another worker, a bounded number of times; for a disaggregated request that is its
prefill worker (the decode worker is only asked after the first token). Every refusal
that reaches the client is recorded here; once a `Generation` is returned, it records
its own outcome.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from opentelemetry import trace

from services.router.detokenizer import TokenDecoder
from services.router.disaggregated import DisaggregatedStream
from services.router.errors import BadRequest
from services.router.generation import Generation
from services.router.kv_view import KvView, PrefixSource
from services.router.metrics import RouterMetrics
from services.router.policy import RouteDecision, RouteRequest, context_limit, decide
from services.router.records import Clock, GenerationParams, RequestRecorder, TokenUsage
from services.router.token_source import TokenSource, WorkerPart
from services.router.worker_link import WorkerLink
from services.router.worker_pool import InFlight, WorkerPool
from shared.errors import ErrorCode, TandemError, Unavailable
from shared.schemas import GenerateRequest
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


@dataclass(frozen=True)
class _Routed:
    decision: RouteDecision
    first: InFlight  # the worker asked first: the single worker, or the prefill worker
    decode: InFlight | None  # disaggregated with max_tokens > 1: the decode worker


class Dispatcher:
    def __init__(self, *, link: WorkerLink, pool: WorkerPool, kv_view: KvView, decoder: TokenDecoder, metrics: RouterMetrics,
                 recorder: RequestRecorder, clock: Clock, worker_wait_s: float) -> None:
        self._link = link
        self._pool = pool
        self._kv_view = kv_view
        self._decoder = decoder
        self._metrics = metrics
        self._recorder = recorder
        self._clock = clock
        self._worker_wait_s = worker_wait_s

    async def dispatch(self, params: GenerationParams) -> Generation:
        """A generation whose (first) worker has produced its first output; raises `TandemError`."""
        refused_by: set[str] = set()
        deadline = params.arrived_at + self._worker_wait_s
        while True:
            try:
                routed = await self._route(params, refused_by, deadline)
            except (TandemError, asyncio.CancelledError) as error:
                await self._recorder.record(params, outcome=_outcome(error),
                                            usage=TokenUsage(len(params.prompt_ids), 0, 0))
                raise
            generation = await self._open(params, routed)
            try:
                await generation.prime()
            except Unavailable as error:
                refused_by.add(generation.worker_id)
                if len(refused_by) >= MAX_ATTEMPTS:
                    await generation.close()
                    raise
                log.info("worker %s refused %s (%s); re-routing", generation.worker_id, params.request_id, error)
                await generation.close(record=False)
                continue
            except BaseException:
                await generation.close()
                raise
            if routed.decision.flow == "disaggregated":
                self._metrics.disaggregated_requests.inc()
            return generation

    async def _open(self, params: GenerationParams, routed: _Routed) -> Generation:
        decision = routed.decision
        span = tracer.start_span("router.generate", attributes={
            "tandem.request_id": params.request_id, "tandem.worker_id": decision.worker_id,
            "tandem.flow": decision.flow, "tandem.route_reason": decision.reason,
            "tandem.prompt_tokens": len(params.prompt_ids), "tandem.max_tokens": params.sampling.max_tokens})
        source: TokenSource
        prefix = self._prefix_source(params, routed.first.worker_id)
        if prefix is not None:
            span.set_attribute("tandem.kv.prefix_holder", prefix.worker_id)
            span.set_attribute("tandem.kv.prefix_blocks", len(prefix.block_hashes))
            self._metrics.prefix_pulls_routed.inc()
        if decision.flow == "disaggregated":
            assert decision.prefill_worker_id is not None
            span.set_attribute("tandem.prefill_worker_id", decision.prefill_worker_id)
            disaggregated = DisaggregatedStream(params=params, link=self._link, prefill=routed.first,
                                                decode=routed.decode, metrics=self._metrics, span=span,
                                                prefix=prefix)
            source, send = disaggregated, disaggregated.open()
        else:
            single = WorkerPart(self._link, routed.first, params.request_id)
            with trace.use_span(span, end_on_exit=False):
                headers = inject_headers()
            request = GenerateRequest(request_id=params.request_id, model=params.model,
                                      token_ids=params.prompt_ids, sampling=params.sampling,
                                      kv_transfer=prefix.as_params() if prefix is not None else None)
            source, send = single, single.send(request, headers)
        try:
            await send
        except BaseException as error:  # NATS is down (nothing was sent), or the client left
            try:
                await source.close()  # frees the in-flight slots
            finally:
                span.end()
                await self._recorder.record(params, outcome=_outcome(error), worker_id=routed.first.worker_id,
                                            usage=TokenUsage(len(params.prompt_ids), 0, 0))
            raise
        return Generation(params=params, source=source, decoder=self._decoder, metrics=self._metrics,
                          recorder=self._recorder, clock=self._clock, span=span)

    def _prefix_source(self, params: GenerationParams, worker_id: str) -> PrefixSource | None:
        """Another worker holding more of the prompt than the one computing it: pull from it."""
        views = self._pool.views()
        target = next((view for view in views if view.worker_id == worker_id), None)
        if target is None:
            return None
        return self._kv_view.prefix_holder(params.prompt_ids, target, views)

    async def _route(self, params: GenerationParams, refused_by: set[str], deadline: float) -> _Routed:
        route = RouteRequest(model=params.model, prompt_tokens=len(params.prompt_ids),
                             total_tokens=len(params.prompt_ids) + params.sampling.max_tokens)
        while True:
            views = [view for view in self._pool.views() if view.worker_id not in refused_by]
            decision = decide(views, route)
            if decision is not None:
                # no await between deciding and counting: concurrent requests see this one
                self._metrics.route_decisions.labels(decision.flow, decision.reason).inc()
                if decision.prefill_worker_id is None:
                    return _Routed(decision, self._pool.begin(decision.worker_id, params.request_id), None)
                prefill = self._pool.begin(decision.prefill_worker_id, params.request_id)
                needs_decode = params.sampling.max_tokens > 1
                decode = self._pool.begin(decision.worker_id, params.request_id) if needs_decode else None
                return _Routed(decision, prefill, decode)
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
