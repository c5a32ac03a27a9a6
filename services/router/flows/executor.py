"""The flow executor: runs any `RoutePlan` the routing policy made, as a `TokenSource`.

Called by the source opener (`flows.opener.SourceOpener`) once a plan is committed (its workers counted in flight, its
blocks predicted): `FlowExecutor.start()` records the plan on the request's span and in
the metrics, opens the plan's parts, and sends whatever goes first.

- A single-worker plan is one `WorkerPart` (`services.router.flows.token_source`): the whole
  request on one worker, pulling a cached prefix from a holder first when the plan names
  one; its trace context is the router span's own.
- A disaggregated plan is a `TwoPartStream` (`services.router.flows.two_part`): a prefill part
  and a decode part, each with a child span, run in the order the plan's KV transfer mode
  names (`services.router.flows.handoff`: pull, prefill first; push, decode first).

If sending fails (NATS down) or the caller is cancelled meanwhile, the source is closed
(its in-flight slots freed) before the error propagates.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from dataclasses import dataclass

from opentelemetry import trace

from services.router.fleet.worker_link import WorkerLink
from services.router.fleet.worker_state import InFlight
from services.router.flows.handoff import HandOff, PullHandOff, PushHandOff
from services.router.flows.records import GenerationParams
from services.router.flows.spans import span_headers
from services.router.flows.token_source import TokenSource, WorkerPart
from services.router.flows.two_part import TwoPartStream
from services.router.kv.view import PrefixSource
from services.router.metrics import RouterMetrics
from services.router.routing import RoutePlan
from shared.schemas import GenerateRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CommittedPlan:
    """A plan whose workers are counted in flight."""

    plan: RoutePlan
    first: InFlight  # the computing worker: the single worker, or the prefill worker
    decode: InFlight | None  # the decode part's worker (a disaggregated plan with max_tokens > 1)
    prefix: PrefixSource | None  # the blocks to pull from the plan's prefix holder

    def __post_init__(self) -> None:
        assert (self.decode is None) == (self.plan.decode_worker_id is None), self


class FlowExecutor:
    def __init__(self, link: WorkerLink, metrics: RouterMetrics) -> None:
        self._link = link
        self._metrics = metrics
        self._notes_logged: set[str] = set()  # routing notes already logged (few: one per cause)

    async def start(self, params: GenerationParams, committed: CommittedPlan, span: trace.Span) -> TokenSource:
        """The plan's token source, its first request sent; raises `Unavailable` if it could not be."""
        self._record(committed, span)
        source, send = self._source(params, committed, span)
        try:
            await send
        except BaseException:  # NATS is down (nothing was sent), or the client left
            await source.close()  # frees the in-flight slots
            raise
        return source

    def _source(self, params: GenerationParams, committed: CommittedPlan,
                span: trace.Span) -> tuple[TokenSource, Awaitable[None]]:
        plan, prefix = committed.plan, committed.prefix
        if plan.prefill_worker_id is None:
            single = WorkerPart(self._link, committed.first, params.request_id)
            request = GenerateRequest(request_id=params.request_id, model=params.model,
                                      token_ids=params.prompt_ids, sampling=params.sampling, adapter=params.adapter,
                                      cache_salt=params.cache_salt, kv_transfer=prefix.as_params() if prefix is not None else None,
                                      images=list(params.images))
            return single, single.send(request, span_headers(span))
        handoff: HandOff = PushHandOff() if plan.transfer == "push" else \
            PullHandOff(prefix, hold=committed.decode is not None)
        stream = TwoPartStream(params=params, link=self._link, prefill=committed.first, decode=committed.decode,
                               handoff=handoff, metrics=self._metrics, span=span)
        return stream, stream.open()

    def _record(self, committed: CommittedPlan, span: trace.Span) -> None:
        plan, prefix = committed.plan, committed.prefix
        attributes: dict[str, str | int | float] = {
            "tandem.worker_id": plan.worker_id, "tandem.flow": plan.flow,
            "tandem.route_reason": plan.reason, "tandem.route_cost": plan.cost}
        if plan.note:
            attributes["tandem.route_note"] = plan.note
            if plan.note not in self._notes_logged:  # once per distinct cause, not per request
                self._notes_logged.add(plan.note)
                log.warning("routed %s whole on %s (%s): %s", plan.flow, plan.worker_id, plan.reason, plan.note)
        if plan.prompt is not None:
            attributes["tandem.cached_tokens"] = plan.prompt.cached_tokens
            attributes["tandem.uncached_tokens"] = plan.prompt.uncached_tokens
        if plan.prefill_worker_id is not None:
            attributes["tandem.prefill_worker_id"] = plan.prefill_worker_id
        if plan.transfer is not None:
            attributes["tandem.kv.transfer_mode"] = plan.transfer
            self._metrics.kv_transfer_modes.labels(plan.transfer).inc()
        if prefix is not None:
            attributes["tandem.kv.prefix_holder"] = prefix.worker_id
            attributes["tandem.kv.prefix_blocks"] = len(prefix.block_hashes)
            self._metrics.prefix_pulls_routed.inc()
        span.set_attributes(attributes)
        span.add_event("router.route", attributes)
        if plan.flow == "disaggregated":
            self._metrics.disaggregated_requests.inc()
