"""What routing a request changes, in one place (adapter around `services.router.routing`).

`RoutingState` owns every store a routing decision reads and changes: the model's KV
namespace (`kv.model_kv.ModelKv`, in the `KvView`), its prefix placement
(`routing.placement.Placement`, one per model in `Placements`), and the worker pool's
predicted-load ledgers and the load it shares with the other routers (`WorkerPool`).

- `ask(attempt)` makes one decision over the workers as they are now: how much of the
  prompt each of the model's workers holds (`ModelKv.prompt_cache`), a snapshot of the
  prompt's prefix placement, then `routing.decide` (over a large fleet's shortlist first,
  `routing.shortlist`). It changes nothing.
- `commit(decision, plan)` commits the plan, with no await since `ask` (so concurrent
  requests see each other): its workers are counted in flight (`WorkerPool.begin`; the
  computing worker with the prompt tokens it must compute, until its first token), the
  prompt's blocks are predicted on the computing worker (`ModelKv.predict`: speculative
  index entries, so siblings that arrive before its KV events follow it), the placement
  records the plan (`Placement.record`), and the other routers are told
  (`SharedLoadLink.predicted`).
- `RoutedPrompts.peer_routed(prompt)`: another router routed a prompt; it is predicted and
  recorded here alike. The worker pool is handed it at construction (its shared-load link
  calls it), before this state exists, which is why the KV view's namespaces and the
  placements sit in a part of their own.

Caller: `flows.opener.SourceOpener`, which routes each `Attempt` (`bench.router.route_micro`
calls `ask` and `commit` directly).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from dataclasses import dataclass, field

from opentelemetry import trace

from services.router.config import RoutingConfig
from services.router.fleet.worker_pool import WorkerPool
from services.router.fleet.worker_state import NO_KV_TRANSFER_MARK
from services.router.flows.executor import CommittedPlan
from services.router.flows.records import Clock, GenerationParams, RouteNote
from services.router.kv.view import KvView, ModelKv, PromptCache
from services.router.metrics import RouterMetrics
from services.router.routing import RoutePlan, RouteRefusal, RouteRequest, RoutingPolicy, WorkerView, decide
from services.router.routing.placement.placement import Placement, Placements
from services.router.routing.shortlist import shortlist
from shared.schemas import RoutedPrompt
from shared.schemas.generate import image_spans

log = logging.getLogger(__name__)


def build_of(view: WorkerView) -> str:
    """The worker's compatibility hash (its model build), without the transfer group's suffix
    for a worker that exchanges no KV (`worker_state.transfer_group`)."""
    return view.compat_hash.split(NO_KV_TRANSFER_MARK, 1)[0]


@dataclass(slots=True)
class Attempt:  # read-only by convention (not frozen: built per request, and a frozen dataclass is slow to build)
    """One routing of a request: a new one, or the continuation of one that lost its worker."""

    params: GenerationParams
    span: trace.Span  # the routing and the plan's parts go under it
    deadline: float  # (router clock) past it, no more waiting for a worker that can take it
    excluded: frozenset[str] = frozenset()  # workers this request lost
    admit: bool = True  # a new request (a resumed one was admitted, and keeps its queue time)
    threshold: float = 0.0  # decode-first: the share of the prompt a worker must hold; 0: none
    # a scalable model's request with no token answered yet (a new one, or one refused by a
    # worker that began to drain) is held while no worker can take it
    may_hold: bool = True
    # the request's routing record, the same object for each of its attempts (`records.RouteNote`)
    route: RouteNote = field(default_factory=RouteNote)


@dataclass(slots=True)
class Decision:  # read-only by convention (built per request)
    """What `RoutingState.ask` answered, and what `commit` needs of the moment it was made."""

    attempt: Attempt
    views: list[WorkerView]  # the workers it chose among
    outcome: RoutePlan | RouteRefusal | None  # None: no worker can take it now
    route: RouteRequest
    kv: ModelKv  # the model's KV namespace
    cache: PromptCache  # what that namespace said of the prompt
    placement: Placement  # the model's prefix placement, as `route`'s snapshot saw it


class RoutedPrompts:
    """The model's KV namespaces and prefix placements: what a routed prompt changes besides
    the workers' ledgers, by this router (`RoutingState.commit`) or a peer (`peer_routed`)."""

    def __init__(self, kv_view: KvView, placements: Placements, *, routing: RoutingConfig, clock: Clock) -> None:
        self.kv_view = kv_view
        self.placements = placements  # the prefixes' homes, per model (told of membership by the pool)
        self._ttl_s = routing.speculative_ttl_s
        self._clock = clock

    def peer_routed(self, prompt: RoutedPrompt) -> None:
        """Another router routed a prompt: its blocks are predicted on that worker here too (in
        its model's namespace), and its prefix's placement records it."""
        kv, placement = self.kv_view.of_worker(prompt.worker_id), self.placements.of_worker(prompt.worker_id)
        cache = PromptCache(dict(prompt.chains), {}, {})
        if kv is not None:
            kv.predict(prompt.worker_id, cache, self._clock(), min(prompt.ttl_s, self._ttl_s))
        if placement is not None:
            placement.routed_elsewhere(cache.prefix_key, prompt.worker_id, cache.block_tokens)


class RoutingState:
    def __init__(self, pool: WorkerPool, prompts: RoutedPrompts, *, routing: RoutingConfig, policy: RoutingPolicy,
                 metrics: RouterMetrics, clock: Clock) -> None:
        self._pool = pool
        self.prompts = prompts
        self._routing = routing
        self._policy = policy
        self._random = random.Random(routing.seed)  # the random baseline policy's draws
        self._sample = random.Random(routing.seed + 1)  # a large fleet's shortlist draws
        self._metrics = metrics
        self._clock = clock

    def ask(self, attempt: Attempt) -> Decision:
        """One routing decision over the workers as they are now; changes nothing."""
        params = attempt.params
        prompt_tokens = len(params.prompt_ids)
        now = self._clock()
        decision_started, decision_cpu_started = time.perf_counter(), time.thread_time()
        kv = self.prompts.kv_view.model(params.model)  # only the model's own workers' KV can match
        cache = kv.prompt_cache(params.prompt_ids, now, adapter=params.adapter, cache_salt=params.cache_salt,
                                images=image_spans(params.images))
        if params.sampling.prompt_logprobs is not None:  # computed from scratch where it runs: no pull
            cache = dataclasses.replace(cache, cached_tokens={}, held_tokens={}, tier_tokens={})
        # an adapter's KV moves only between workers that can carry it: else one worker serves it whole
        whole_here = bool(params.adapter) and not self._pool.moves_adapter_kv(params.model)
        if whole_here:
            cache = dataclasses.replace(cache, held_tokens={})
        placement = self.prompts.placements.model(params.model)
        route = RouteRequest(model=params.model, adapter=params.adapter, prompt_tokens=prompt_tokens,
                             total_tokens=prompt_tokens + params.sampling.max_tokens,
                             cached_tokens=cache.cached_tokens, held_tokens=cache.held_tokens,
                             tier_tokens=cache.tier_tokens, cache_hit_threshold=attempt.threshold,
                             admit=attempt.admit, draw=self._random.random(),
                             one_engine=params.sampling.needs_whole_prompt or whole_here,
                             replays=params.sampling.depends_on_output_history,
                             route_hint=params.route_hint, prefix_key=cache.prefix_key,
                             victim_age_s=kv.victim_ages(now), block_tokens=cache.block_tokens,
                             placement=placement.snapshot(cache.prefix_key))
        views, outcome = self._decide(route, attempt.excluded, attempt.route.compat_hash)
        self._metrics.route_decision_time.observe(time.perf_counter() - decision_started)
        self._metrics.route_decision_cpu.observe(time.thread_time() - decision_cpu_started)
        return Decision(attempt, views, outcome, route, kv, cache, placement)

    def _decide(self, route: RouteRequest, excluded: frozenset[str], compat_hash: str) -> tuple[
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

    def commit(self, decision: Decision, plan: RoutePlan) -> CommittedPlan:
        """Count the plan's workers, predict its blocks and record its prefix's placement:
        synchronous, right after `ask` (the placement is as the decision's snapshot saw it)."""
        params, cache, kv = decision.attempt.params, decision.cache, decision.kv
        ttl_s = self._routing.speculative_ttl_s
        self._metrics.count_route(plan.flow, plan.reason)
        computing = plan.computing_worker_id
        uncached = plan.prompt.uncached_tokens if plan.prompt is not None else len(params.prompt_ids)
        first = self._pool.begin(computing, params.request_id, prefill_tokens=uncached,
                                 decodes=plan.decode_worker_id is None)
        decode = None
        if plan.decode_worker_id is not None:
            decode = self._pool.begin(plan.decode_worker_id, params.request_id)
        kv.predict(computing, cache, self._clock(), ttl_s)
        decision.placement.record(decision.route, plan)
        self._pool.shared_load.predicted(computing, cache.chains, ttl_s)
        prefix = None
        if plan.prompt is not None and plan.prompt.holder_id is not None:
            prefix = kv.prefix_source(cache, plan.prompt.holder_id,
                                      plan.prompt.cached_tokens + plan.prompt.pulled_tokens)
        if log.isEnabledFor(logging.DEBUG):
            _log_commit(params, plan, cache, uncached)
        return CommittedPlan(plan, first, decode, prefix)


def _log_commit(params: GenerationParams, plan: RoutePlan, cache: PromptCache, uncached: int) -> None:
    log.debug("%s: %s (%s) on %s%s, cost %.1f, %d of %d prompt tokens uncached, prefix %s, cached %s",
              params.request_id, plan.flow, plan.reason, plan.worker_id,
              f" after {plan.prefill_worker_id}" if plan.prefill_worker_id else "", plan.cost,
              uncached, len(params.prompt_ids), f"{cache.prefix_key:016x}" if cache.prefix_key else "-",
              ",".join(f"{worker_id}:{tokens}" for worker_id, tokens in sorted(cache.cached_tokens.items())
                       if tokens) or "-")
