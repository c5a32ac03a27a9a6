"""Dispatching a request: admission, then its `Generation` on a routed source.

`Dispatcher.dispatch()` takes a new request: it passes the admission gate first
(`flows.admission`: its key's tokens per minute, and the router's admission queue when on;
a refusal is `TooManyRequests`, 429 with `Retry-After`), which it leaves when its generation
closes. The source opener (`flows.opener.SourceOpener`) routes it and starts its plan's
flow (a routing `Attempt`: see `flows.routing_state` for what routing commits, and
`flows.worker_wait` for how long it may wait for a worker); the `Generation` wraps that
source, with the opener as its `Resumer`, and `dispatch` returns it once it has produced its
first output. Every refusal that reaches the client before a `Generation` exists is recorded
here; after that, the `Generation` records its own outcome.
"""

from __future__ import annotations

from collections.abc import Callable

from opentelemetry import trace

from services.router.config import RoutingConfig
from services.router.flows.admission import AdmissionGate, Ticket
from services.router.flows.detokenizer import TokenDecoder
from services.router.flows.generation import Generation
from services.router.flows.opener import SourceOpener
from services.router.flows.records import Clock, GenerationParams, RequestRecorder, RouteNote, TokenUsage
from services.router.flows.routing_state import Attempt
from services.router.flows.spans import child_span, outcome_of
from services.router.metrics import RouterMetrics


class Dispatcher:
    def __init__(self, opener: SourceOpener, admission: AdmissionGate, *, decoders: Callable[[str], TokenDecoder],
                 metrics: RouterMetrics, recorder: RequestRecorder, clock: Clock, worker_wait_s: float,
                 routing: RoutingConfig = RoutingConfig(), max_attempts: int = 3) -> None:
        self._opener = opener
        self.admission = admission
        self._worker_wait_s = worker_wait_s  # from its arrival, how long a request may wait for a worker
        self._decoders = decoders  # a model's name -> its tokenizer
        self._metrics = metrics
        self._recorder = recorder
        self._clock = clock
        self._cache_hit_threshold = routing.cache_hit_threshold  # a request's default
        self._max_attempts = max_attempts

    async def dispatch(self, params: GenerationParams) -> Generation:
        """A generation that has produced its first output; raises `TandemError`."""
        span = child_span("router.generate", trace.get_current_span(), attributes={
            "tandem.request_id": params.request_id, "tandem.prompt_tokens": len(params.prompt_ids),
            "tandem.max_tokens": params.sampling.max_tokens})
        threshold = params.cache_hit_threshold
        if threshold is None:
            threshold = self._cache_hit_threshold
        if threshold:
            span.set_attribute("tandem.cache_hit_threshold", threshold)
        ticket: Ticket | None = None
        route = RouteNote()  # the request's routing record, for each of its attempts
        try:
            ticket = await self.admission.enter(params)
            deadline = params.arrived_at + self._worker_wait_s
            source = await self._opener.open(Attempt(params, span, deadline, threshold=threshold, route=route))
        except BaseException as error:
            if ticket is not None:
                self.admission.leave(ticket, None)
            span.set_attribute("tandem.outcome", outcome_of(error))
            span.end()
            await self._recorder.record(params, outcome=outcome_of(error),
                                        usage=TokenUsage(len(params.prompt_ids), 0, 0), span=span, route=route)
            raise
        generation = Generation(params=params, source=source, decoder=self._decoders(params.model), metrics=self._metrics,
                                recorder=self._recorder, clock=self._clock, span=span, route=route, resumer=self._opener,
                                max_attempts=self._max_attempts,
                                on_close=lambda usage: self.admission.leave(ticket, usage))
        try:
            await generation.prime()
        except BaseException:
            await generation.close()
            raise
        return generation
