"""Opening a request's token source: route an `Attempt`, then start its plan's flow.

`SourceOpener.open(attempt)` asks the routing state for a decision (`RoutingState.ask`) and
commits it at once (`RoutingState.commit`); while no worker can take the request it waits
(`flows.worker_wait`) and asks again. Only then does the flow executor
(`services.router.flows.executor`) run the plan: one worker, or a prefill and a decode
worker, pulling a cached prefix from a holder when the plan names one. A decode-first
request whose threshold no worker meets gets an `Answered` source with finish_reason
"cache_threshold" (HTTP 200, no tokens); every worker at its queue limit is
`TooManyRequests` (429 with `Retry-After`).

A worker lost before or during generation is replaced through `resume()`, the `Resumer` of
every `Generation` (which decides when): the continuation is routed like a new request,
minus the workers already lost, without admission control or cache threshold (it was
admitted), and without waiting (see `WorkerWait.resumed_deadline`): if no worker can take
it now, the client gets the original error. A scalable model's request that no worker
answered yet is held again (its worker began an idle drain as it was routed).

The request's `RouteNote` (its `Attempt.route`, the same object for its resumed copies) is
written here only: its first decision, its workers' model build, its time in the queue.

Caller: `flows.dispatch.Dispatcher` (a new request), `flows.generation.Generation` (a resumed one).
"""

from __future__ import annotations

import dataclasses

from opentelemetry import trace

from services.router.flows.executor import CommittedPlan, FlowExecutor
from services.router.flows.records import OUTCOME_OK, Clock, GenerationParams, RouteNote
from services.router.flows.routing_state import Attempt, Decision, RoutingState, build_of
from services.router.flows.spans import child_span, end_span, outcome_of
from services.router.flows.token_source import Answered, TokenSource
from services.router.flows.worker_wait import WorkerWait
from services.router.metrics import RouterMetrics
from services.router.openai.errors import BadRequest, TooManyRequests
from services.router.routing import RoutePlan, RouteRefusal, WorkerView, context_limit
from services.router.routing.cold_start import Hold
from shared.prometheus import trace_exemplar
from shared.schemas import Finished
from shared.schemas.generate import FinishReason


def answered(params: GenerationParams, finish_reason: FinishReason, cached_tokens: int = 0) -> Answered:
    """A source that answers without a worker."""
    return Answered(Finished(seq=0, finish_reason=finish_reason,
                             prompt_tokens=len(params.prompt_ids), cached_tokens=cached_tokens,
                             completion_tokens=0))


def _note_route(route: RouteNote, span: trace.Span, flow: str, reason: str) -> None:
    """The decision on its span, and on the request's record (the first decision only)."""
    span.set_attributes({"tandem.flow": flow, "tandem.route_reason": reason})
    if not route.flow:
        route.flow, route.reason = flow, reason


class SourceOpener:
    def __init__(self, state: RoutingState, waits: WorkerWait, flows: FlowExecutor, *, metrics: RouterMetrics,
                 clock: Clock, retry_after_s: float) -> None:
        self._state = state
        self._waits = waits
        self._flows = flows
        self._metrics = metrics
        self._clock = clock
        self._retry_after_s = retry_after_s  # of a 429 when every worker is at its queue limit

    async def open(self, attempt: Attempt) -> TokenSource:
        """The attempt's source, its plan's parts sent; raises `TandemError`."""
        params, span = attempt.params, attempt.span
        route_span = child_span("router.route", span)
        with trace.use_span(route_span, end_on_exit=route_span is not span):
            routed = await self._route(attempt, route_span)
        if isinstance(routed, RouteRefusal):  # decode-first, and no worker holds enough of the prompt
            span.set_attributes({"tandem.flow": "none", "tandem.route_reason": routed.reason,
                                 "tandem.cached_tokens": routed.cached_tokens})
            return answered(params, "cache_threshold", routed.cached_tokens)
        if attempt.admit:  # a new request, not a resumed one
            attempt.route.queue_s = max(0.0, self._clock() - params.arrived_at)
            self._metrics.observe_queue(routed.plan.computing_worker_id, attempt.route.queue_s, trace_exemplar(span))
        return await self._flows.start(params, routed, span)

    async def resume(self, params: GenerationParams, route: RouteNote, generated: list[int], excluded: set[str],
                     attempt: int, span: trace.Span) -> TokenSource:
        """A source continuing `params` (routed as `route` says) after `generated`, on a worker
        not in `excluded`."""
        remaining = params.sampling.max_tokens - len(generated)
        if generated and generated[-1] in params.sampling.stop_token_ids:
            return answered(params, "stop")  # lost between the last token and its `Finished`
        if remaining <= 0:
            return answered(params, "length")
        if not generated:  # nothing answered yet: a plain retry, on any model build
            route.compat_hash = ""
        appended, sampling = params.sampling.continue_after(generated)
        continued = dataclasses.replace(
            params, request_id=f"{params.request_id}-r{attempt}",  # the worker may still know the first id
            prompt_ids=[*params.prompt_ids, *appended], sampling=sampling)
        # The continuation's routing and parts are children of this span, which ends once the
        # continuation is sent (its parts go on under it).
        resume_span = child_span("router.resume", span, attributes={
            "tandem.request_id": continued.request_id, "tandem.attempt": attempt,
            "tandem.generated_tokens": len(generated), "tandem.excluded_workers": sorted(excluded)})
        try:
            source = await self.open(Attempt(continued, resume_span, self._waits.resumed_deadline(),
                                             frozenset(excluded), admit=False, threshold=0.0,
                                             may_hold=not generated, route=route))
        except BaseException as error:
            end_span(resume_span, outcome_of(error))
            raise
        end_span(resume_span, OUTCOME_OK)
        return source

    async def _route(self, attempt: Attempt, span: trace.Span) -> CommittedPlan | RouteRefusal:
        params = attempt.params
        hold: Hold | None = None  # a scalable model's request, held while its worker starts
        try:
            while True:
                decision = self._ask(attempt, span)
                outcome = decision.outcome
                if hold is not None and isinstance(outcome, RoutePlan) and \
                        self._waits.awaits_prefill(params.model, decision.views, outcome):
                    outcome = None  # its decode worker is up first: wait for the prefill one
                if isinstance(outcome, RoutePlan):
                    self._note_plan(decision, outcome, span)
                    if hold is not None:
                        self._waits.release(params.model, routed=True)
                        hold = None
                    return self._state.commit(decision, outcome)
                if isinstance(outcome, RouteRefusal):
                    return self._refused(attempt, outcome, span)
                _check_context(params, decision.views)
                if attempt.may_hold and hold is None and self._waits.scalable(params.model):
                    hold = self._waits.hold(params)
                await self._waits.wait(params, attempt.deadline if hold is None else max(attempt.deadline, hold.deadline),
                                       hold)
        finally:
            if hold is not None:
                self._waits.release(params.model, routed=False)

    def _ask(self, attempt: Attempt, span: trace.Span) -> Decision:
        decision = self._state.ask(attempt)
        span.set_attributes({"tandem.route_candidates": len(decision.views),
                             "tandem.prompt_tokens": len(attempt.params.prompt_ids),
                             "tandem.max_cached_tokens": max(decision.cache.cached_tokens.values(), default=0)})
        return decision

    @staticmethod
    def _note_plan(decision: Decision, plan: RoutePlan, span: trace.Span) -> None:
        """The plan on its span, and on the request's record (with its workers' model build)."""
        route = decision.attempt.route
        _note_route(route, span, plan.flow, plan.reason)
        if not route.compat_hash:
            route.compat_hash = next(build_of(view) for view in decision.views if view.worker_id == plan.worker_id)
        if plan.prompt is not None:  # the computing worker: held, pulled from a holder, computed
            span.set_attributes({"tandem.cached_tokens": plan.prompt.cached_tokens,
                                 "tandem.pulled_tokens": plan.prompt.pulled_tokens,
                                 "tandem.uncached_tokens": plan.prompt.uncached_tokens})

    def _refused(self, attempt: Attempt, refusal: RouteRefusal, span: trace.Span) -> RouteRefusal:
        params = attempt.params
        _note_route(attempt.route, span, "none", refusal.reason)
        self._metrics.count_route("none", refusal.reason)
        if refusal.reason == "overloaded":
            raise TooManyRequests(f"every worker serving {params.model!r} is at its queue limit; "
                                  f"retry later", retry_after_s=self._retry_after_s)
        return refusal


def _check_context(params: GenerationParams, views: list[WorkerView]) -> None:
    prompt_tokens = len(params.prompt_ids)
    total_tokens = prompt_tokens + params.sampling.max_tokens
    limit = context_limit(views, params.model)
    if limit is not None and total_tokens > limit:
        raise BadRequest(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{total_tokens} tokens ({prompt_tokens} in the prompt, "
            f"{params.sampling.max_tokens} for the completion). Please reduce the prompt or max_tokens.",
            param="max_tokens", api_code="context_length_exceeded")
