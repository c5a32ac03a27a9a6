"""Routing a request to its worker(s) and starting its flow (adapter around `routing`).

Each attempt asks the KV view how much of the prompt every worker holds and the prefix's
placement (`routing.placement.Placement`, one per model, held here) for a snapshot of it,
lets the routing policy plan (`services.router.routing.decide`), then commits the plan with
no await in between, so concurrent requests see each other: the plan's workers are counted
in flight (`WorkerPool.begin`; the computing worker with the prompt tokens it must compute,
until its first token), the prompt's blocks are predicted on the computing worker
(`ModelKv.predict`, in the model's KV namespace: speculative index entries), so siblings
that arrive before its KV events follow it, and the placement records the plan
(`Placement.record`); the other routers of the cluster are told both
(`WorkerPool.shared_load`), and their routings are predicted and recorded here alike. Only
then does the flow executor (`services.router.flows.executor`) run the plan: one worker, or
a prefill and a decode worker, pulling a cached prefix from a holder when the plan names
one.

Before routing, a new request passes the admission gate (`flows.admission`: its key's tokens
per minute, and the router's admission queue when on), and leaves it when its generation
closes. Answers without a worker: a refusal of admission control is `TooManyRequests` (429 with
`Retry-After`); a decode-first request whose threshold no worker meets gets an
`Answered` source with finish_reason "cache_threshold" (HTTP 200, no tokens).

A request waits up to `worker_wait_s` (from its arrival) for a worker that can take it. A
scalable model's request (`ScaleFromZeroConfig`) that no worker can take is held instead
(`routing.cold_start`: a bounded number per model, each up to `hold_s`; past either, 503 with
`Retry-After`) while the orchestrator is asked for a worker (`fleet.model_waker`), and routed
when one registers (a disaggregated one's, once its prefill worker did too: `awaits_prefill`).
A worker lost before or during generation is replaced through `resume()` (the
`Generation` decides when): the continuation is routed like a new request, minus the
workers already lost, without admission control or cache threshold (it was admitted),
and without waiting (but for a few seconds after a NATS reconnect, see `WorkerPool`): if
no worker can take it now, the client gets the original error. A scalable model's request
that no worker answered yet is held again (its worker began an idle drain as it was routed).
Every refusal that reaches the client before a `Generation` exists is recorded here;
after that, the `Generation` records its own outcome.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Callable

from opentelemetry import trace

from services.router.config import AdmissionConfig, RoutingConfig, ScaleFromZeroConfig
from services.router.fleet.model_waker import ModelWaker
from services.router.fleet.worker_link import WorkerLink
from services.router.fleet.worker_pool import NO_KV_TRANSFER_MARK, WorkerPool
from services.router.flows.admission import AdmissionGate, Ticket
from services.router.flows.detokenizer import TokenDecoder
from services.router.flows.executor import CommittedPlan, FlowExecutor
from services.router.flows.generation import Generation
from services.router.flows.records import OUTCOME_OK, Clock, GenerationParams, RequestRecorder, TokenUsage
from services.router.flows.spans import child_span, end_span
from services.router.flows.token_source import Answered, TokenSource
from services.router.kv.view import KvView, ModelKv, PromptCache
from services.router.metrics import RouterMetrics
from services.router.openai.errors import BadRequest, NoWorkerYet, TooManyRequests
from services.router.routing import (
    RoutePlan,
    RouteRefusal,
    RouteRequest,
    RoutingPolicy,
    WorkerView,
    build_policy,
    context_limit,
    decide,
)
from services.router.routing.cold_start import ColdStarts, Hold, HoldRefused
from services.router.routing.placement.placement import Placements
from services.router.routing.shortlist import shortlist
from shared.errors import ErrorCode, TandemError, Unavailable
from shared.prometheus import trace_exemplar
from shared.schemas import Finished, RoutedPrompt
from shared.schemas.generate import FinishReason

log = logging.getLogger(__name__)


def _outcome(error: BaseException) -> str:
    if isinstance(error, TandemError):
        return error.code.value
    if isinstance(error, asyncio.CancelledError):
        return ErrorCode.CANCELLED.value
    return ErrorCode.UNAVAILABLE.value


def build_of(view: WorkerView) -> str:
    """The worker's compatibility hash (its model build), without the transfer group's suffix
    for a worker that exchanges no KV (`worker_pool.transfer_group`)."""
    return view.compat_hash.split(NO_KV_TRANSFER_MARK, 1)[0]


def _note_route(params: GenerationParams, span: trace.Span, flow: str, reason: str) -> None:
    """The decision on its span, and on the request's record (the first decision only)."""
    span.set_attributes({"tandem.flow": flow, "tandem.route_reason": reason})
    if not params.route.flow:
        params.route.flow, params.route.reason = flow, reason


def _answered(params: GenerationParams, finish_reason: FinishReason, cached_tokens: int = 0) -> Answered:
    return Answered(Finished(seq=0, finish_reason=finish_reason,
                             prompt_tokens=len(params.prompt_ids), cached_tokens=cached_tokens,
                             completion_tokens=0))


class Dispatcher:
    def __init__(self, *, link: WorkerLink, pool: WorkerPool, kv_view: KvView, placements: Placements,
                 decoders: Callable[[str], TokenDecoder],
                 metrics: RouterMetrics, recorder: RequestRecorder, clock: Clock, worker_wait_s: float,
                 routing: RoutingConfig = RoutingConfig(), policy: RoutingPolicy | None = None,
                 max_attempts: int = 3, admission: AdmissionConfig = AdmissionConfig(),
                 scale_from_zero: ScaleFromZeroConfig = ScaleFromZeroConfig(),
                 waker: ModelWaker | None = None) -> None:
        self._flows = FlowExecutor(link, metrics)
        self._pool = pool
        self._kv_view = kv_view
        self._placements = placements  # the prefixes' homes, per model (told of membership by the pool)
        self._decoders = decoders  # a model's name -> its tokenizer
        self._random = random.Random(routing.seed)  # the random baseline policy's draws
        self._sample = random.Random(routing.seed + 1)  # a large fleet's shortlist draws
        self._metrics = metrics
        self._recorder = recorder
        self._clock = clock
        self._worker_wait_s = worker_wait_s
        self._routing = routing
        self._policy = policy if policy is not None else build_policy(routing)
        self._max_attempts = max_attempts
        self.admission = AdmissionGate(admission, pool.views, clock, retry_after=routing.retry_after_s)
        self._scale_from_zero = scale_from_zero
        self._cold_starts = ColdStarts.of(scale_from_zero)
        assert waker is not None or not self._cold_starts.models, "scalable models need a waker"
        metrics.held.set_function(self._cold_starts.total_held)
        self._waker = waker
        pool.shared_load.on_peer_prediction = self._peer_routed

    def _peer_routed(self, prompt: RoutedPrompt) -> None:
        """Another router routed a prompt: its blocks are predicted on that worker here too (in
        its model's namespace), and its prefix's placement records it."""
        kv, placement = self._kv_view.of_worker(prompt.worker_id), self._placements.of_worker(prompt.worker_id)
        cache = PromptCache(dict(prompt.chains), {}, {})
        if kv is not None:
            kv.predict(prompt.worker_id, cache, self._clock(), min(prompt.ttl_s, self._routing.speculative_ttl_s))
        if placement is not None:
            placement.routed_elsewhere(cache.prefix_key, prompt.worker_id, cache.block_tokens)

    async def dispatch(self, params: GenerationParams) -> Generation:
        """A generation that has produced its first output; raises `TandemError`."""
        span = child_span("router.generate", trace.get_current_span(), attributes={
            "tandem.request_id": params.request_id, "tandem.prompt_tokens": len(params.prompt_ids),
            "tandem.max_tokens": params.sampling.max_tokens})
        threshold = params.cache_hit_threshold
        if threshold is None:
            threshold = self._routing.cache_hit_threshold
        if threshold:
            span.set_attribute("tandem.cache_hit_threshold", threshold)
        ticket: Ticket | None = None
        try:
            ticket = await self.admission.enter(params)
            source = await self._open_routed(params, set(), params.arrived_at + self._worker_wait_s, span,
                                             admit=True, threshold=threshold, may_hold=True)
        except BaseException as error:
            if ticket is not None:
                self.admission.leave(ticket, None)
            span.set_attribute("tandem.outcome", _outcome(error))
            span.end()
            await self._recorder.record(params, outcome=_outcome(error),
                                        usage=TokenUsage(len(params.prompt_ids), 0, 0), span=span)
            raise
        generation = Generation(params=params, source=source, decoder=self._decoders(params.model), metrics=self._metrics,
                                recorder=self._recorder, clock=self._clock, span=span, resumer=self,
                                max_attempts=self._max_attempts,
                                on_close=lambda usage: self.admission.leave(ticket, usage))
        try:
            await generation.prime()
        except BaseException:
            await generation.close()
            raise
        return generation

    async def resume(self, params: GenerationParams, generated: list[int], excluded: set[str], attempt: int,
                     span: trace.Span) -> TokenSource:
        """A source continuing `params` after `generated`, on a worker not in `excluded`."""
        remaining = params.sampling.max_tokens - len(generated)
        if generated and generated[-1] in params.sampling.stop_token_ids:
            return _answered(params, "stop")  # lost between the last token and its `Finished`
        if remaining <= 0:
            return _answered(params, "length")
        if not generated:  # nothing answered yet: a plain retry, on any model build
            params.route.compat_hash = ""
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
            # No waiting for a worker to appear (the client's stream is already open and stalled),
            # except just after a NATS reconnect, while the workers re-register.
            source = await self._open_routed(continued, excluded, self._clock() + self._pool.resync_wait_s(),
                                             resume_span, admit=False, threshold=0.0, may_hold=not generated)
        except BaseException as error:
            end_span(resume_span, _outcome(error))
            raise
        end_span(resume_span, OUTCOME_OK)
        return source

    async def _open_routed(self, params: GenerationParams, excluded: set[str], deadline: float, span: trace.Span,
                           *, admit: bool, threshold: float, may_hold: bool) -> TokenSource:
        route_span = child_span("router.route", span)
        with trace.use_span(route_span, end_on_exit=route_span is not span):
            routed = await self._route(params, excluded, deadline, admit=admit, threshold=threshold, may_hold=may_hold,
                                       span=route_span)
        if admit and not isinstance(routed, RouteRefusal):  # a new request, not a resumed one
            params.route.queue_s = max(0.0, self._clock() - params.arrived_at)
            self._metrics.observe_queue(routed.plan.computing_worker_id, params.route.queue_s, trace_exemplar(span))
        if isinstance(routed, RouteRefusal):  # decode-first, and no worker holds enough of the prompt
            span.set_attributes({"tandem.flow": "none", "tandem.route_reason": routed.reason,
                                 "tandem.cached_tokens": routed.cached_tokens})
            return _answered(params, "cache_threshold", routed.cached_tokens)
        return await self._flows.start(params, routed, span)

    def _decide(self, route: RouteRequest, excluded: set[str], compat_hash: str) -> tuple[
            list[WorkerView], RoutePlan | RouteRefusal | None]:
        """`decide` over a large fleet's shortlist (`routing.shortlist`), or over every worker
        when there is none, or when the shortlist has no eligible worker or only full ones;
        only workers of `compat_hash` when given (a resumed request's first build)."""

        def allowed(view: WorkerView) -> bool:
            return view.worker_id not in excluded and (not compat_hash or build_of(view) == compat_hash)

        ids = shortlist(self._pool.member_ids(), route, self._routing, self._sample)
        if ids is not None:
            views = [view for view in self._pool.views(ids) if allowed(view)]
            outcome = decide(views, route, self._routing, self._policy)
            if outcome is not None and not (isinstance(outcome, RouteRefusal) and outcome.reason == "overloaded"):
                return views, outcome
        views = [view for view in self._pool.views() if allowed(view)]
        return views, decide(views, route, self._routing, self._policy)

    async def _route(self, params: GenerationParams, excluded: set[str], deadline: float, *, admit: bool,
                     threshold: float, may_hold: bool, span: trace.Span) -> CommittedPlan | RouteRefusal:
        """`may_hold`: a scalable model's request with no token answered yet (a new one, or one
        refused by a worker that began to drain) is held while no worker can take it."""
        hold: Hold | None = None  # a scalable model's request, held while its worker starts
        try:
            while True:
                views, outcome, route, kv, cache = self._attempt(params, excluded, admit=admit, threshold=threshold,
                                                                 span=span)
                if hold is not None and isinstance(outcome, RoutePlan) and self._waker is not None and \
                        self._cold_starts.awaits_prefill(params.model, views, whole=outcome.prefill_worker_id is None,
                                                         waking=self._waker.waking(params.model)):
                    outcome = None  # its decode worker is up first: wait for the prefill one
                if isinstance(outcome, RoutePlan):
                    _note_route(params, span, outcome.flow, outcome.reason)
                    if not params.route.compat_hash:
                        params.route.compat_hash = next(build_of(view) for view in views
                                                        if view.worker_id == outcome.worker_id)
                    if outcome.prompt is not None:  # the computing worker: held, pulled from a holder, computed
                        span.set_attributes({"tandem.cached_tokens": outcome.prompt.cached_tokens,
                                             "tandem.pulled_tokens": outcome.prompt.pulled_tokens,
                                             "tandem.uncached_tokens": outcome.prompt.uncached_tokens})
                    if hold is not None:
                        self._cold_starts.release(params.model, routed=True)
                        hold = None
                    return self._commit(params, outcome, route, kv, cache)
                if isinstance(outcome, RouteRefusal):
                    _note_route(params, span, "none", outcome.reason)
                    self._metrics.count_route("none", outcome.reason)
                    if outcome.reason == "overloaded":
                        raise TooManyRequests(f"every worker serving {params.model!r} is at its queue limit; "
                                              f"retry later", retry_after_s=self._routing.retry_after_s)
                    return outcome
                self._check_context(params, views)
                if may_hold and hold is None and self._cold_starts.scalable(params.model):
                    hold = self._hold(params)
                await self._wait_for_worker(params, deadline if hold is None else max(deadline, hold.deadline), hold)
        finally:
            if hold is not None:
                self._cold_starts.release(params.model, routed=False)

    def _attempt(self, params: GenerationParams, excluded: set[str], *, admit: bool, threshold: float,
                 span: trace.Span) -> tuple[list[WorkerView], RoutePlan | RouteRefusal | None, RouteRequest, ModelKv,
                                            PromptCache]:
        """One routing decision over the workers as they are now."""
        prompt_tokens = len(params.prompt_ids)
        now = self._clock()
        decision_started, decision_cpu_started = time.perf_counter(), time.thread_time()
        kv = self._kv_view.model(params.model)  # only the model's own workers' KV can match
        cache = kv.prompt_cache(params.prompt_ids, now, adapter=params.adapter)
        if params.sampling.prompt_logprobs is not None:  # computed from scratch where it runs: no pull
            cache = dataclasses.replace(cache, cached_tokens={}, held_tokens={}, tier_tokens={})
        # an adapter's KV moves only between workers that can carry it: else one worker serves it whole
        whole_here = bool(params.adapter) and not self._pool.moves_adapter_kv(params.model)
        if whole_here:
            cache = dataclasses.replace(cache, held_tokens={})
        route = RouteRequest(model=params.model, adapter=params.adapter, prompt_tokens=prompt_tokens,
                             total_tokens=prompt_tokens + params.sampling.max_tokens,
                             cached_tokens=cache.cached_tokens, held_tokens=cache.held_tokens,
                             tier_tokens=cache.tier_tokens, cache_hit_threshold=threshold, admit=admit,
                             draw=self._random.random(),
                             one_engine=params.sampling.needs_whole_prompt or whole_here,
                             replays=params.sampling.depends_on_output_history,
                             route_hint=params.route_hint, prefix_key=cache.prefix_key,
                             victim_age_s=kv.victim_ages(now), block_tokens=cache.block_tokens,
                             placement=self._placements.model(params.model).snapshot(cache.prefix_key))
        views, outcome = self._decide(route, excluded, params.route.compat_hash)
        self._metrics.route_decision_time.observe(time.perf_counter() - decision_started)
        self._metrics.route_decision_cpu.observe(time.thread_time() - decision_cpu_started)
        span.set_attributes({"tandem.route_candidates": len(views), "tandem.prompt_tokens": prompt_tokens,
                             "tandem.max_cached_tokens": max(cache.cached_tokens.values(), default=0)})
        return views, outcome, route, kv, cache

    @staticmethod
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

    def _hold(self, params: GenerationParams) -> Hold:
        """Admit a scalable model's request to wait for a worker to start; raises `NoWorkerYet`
        (503, Retry-After) when too many wait already."""
        held = self._cold_starts.hold(params.model, params.arrived_at)
        if isinstance(held, HoldRefused):
            raise NoWorkerYet(f"no worker serves model {params.model!r} yet and {held.reason}; retry later",
                              retry_after_s=self._scale_from_zero.retry_after_s)
        return held

    async def _wait_for_worker(self, params: GenerationParams, deadline: float, hold: Hold | None) -> None:
        """Until the membership changes (while held: or the orchestrator answers, or the next
        ask for a worker is due); past `deadline`, `Unavailable`. A held request gets
        `NoWorkerYet` (503 with `Retry-After`) past its deadline, or at once when the
        orchestrator refused to start a worker of its model."""
        now = self._clock()
        remaining = deadline - now
        if hold is None or self._waker is None:
            if remaining <= 0:
                raise Unavailable(f"no worker is available for model {params.model!r} "
                                  f"(waited {self._worker_wait_s:g}s)")
            await self._pool.wait_for_change(remaining)
            return
        waker, retry_after_s = self._waker, self._scale_from_zero.retry_after_s
        refusal = waker.refusal(params.model)
        if refusal:
            raise NoWorkerYet(f"no worker serves model {params.model!r} and none is starting: {refusal}",
                              retry_after_s=retry_after_s)
        if remaining <= 0:
            raise NoWorkerYet(f"no worker of model {params.model!r} started within "
                              f"{self._scale_from_zero.hold_s:g}s", retry_after_s=retry_after_s)
        if self._cold_starts.should_ask(params.model, now):
            waker.wake(params.model)
        wait_s = min(remaining, self._scale_from_zero.ask_every_s)
        waits = [asyncio.ensure_future(self._pool.wait_for_change(wait_s)),
                 asyncio.ensure_future(waker.wait_for_answer(wait_s))]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()

    def _commit(self, params: GenerationParams, plan: RoutePlan, route: RouteRequest, kv: ModelKv,
                cache: PromptCache) -> CommittedPlan:
        """Count the plan's workers, predict its blocks and record its prefix's placement:
        synchronous, right after `decide` (the placement is as `route`'s snapshot saw it)."""
        self._metrics.count_route(plan.flow, plan.reason)
        computing = plan.computing_worker_id
        uncached = plan.prompt.uncached_tokens if plan.prompt is not None else len(params.prompt_ids)
        first = self._pool.begin(computing, params.request_id, prefill_tokens=uncached)
        decode = None
        if plan.decode_worker_id is not None:
            decode = self._pool.begin(plan.decode_worker_id, params.request_id)
        kv.predict(computing, cache, self._clock(), self._routing.speculative_ttl_s)
        self._placements.model(params.model).record(route, plan)
        self._pool.shared_load.predicted(computing, cache.chains, self._routing.speculative_ttl_s)
        prefix = None
        if plan.prompt is not None and plan.prompt.holder_id is not None:
            prefix = kv.prefix_source(cache, plan.prompt.holder_id,
                                      plan.prompt.cached_tokens + plan.prompt.pulled_tokens)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s: %s (%s) on %s%s, cost %.1f, %d of %d prompt tokens uncached, prefix %s, cached %s",
                      params.request_id, plan.flow, plan.reason, plan.worker_id,
                      f" after {plan.prefill_worker_id}" if plan.prefill_worker_id else "", plan.cost,
                      uncached, len(params.prompt_ids), f"{cache.prefix_key:016x}" if cache.prefix_key else "-",
                      ",".join(f"{worker_id}:{tokens}" for worker_id, tokens in sorted(cache.cached_tokens.items())
                               if tokens) or "-")
        return CommittedPlan(plan, first, decode, prefix)
