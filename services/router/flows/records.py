"""What a request is, what it produced, and the one record of how it ended.

`RequestRecorder.record()` runs once per request that reached the serving layer: it
updates the router's metrics and publishes a `RequestRecord` on `request_events` for
the metrics collector.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry import trace

from services.router.metrics import RouterMetrics
from services.router.routing.admission import DEFAULT_TENANT, Tenant
from shared.bus import Bus
from shared.codec import encode
from shared.prometheus import trace_exemplar
from shared.schemas import RequestRecord, SamplingParams
from shared.schemas.generate import ImageInput
from shared.subjects import Subjects

log = logging.getLogger(__name__)

Clock = Callable[[], float]
OUTCOME_OK = "ok"


@dataclass(frozen=True)
class RequestIdentity:
    request_id: str
    endpoint: str  # "completions" | "chat"
    model: str
    arrived_at: float  # router clock


@dataclass
class RouteNote:
    """The routing decision a request was admitted with (its first one: a resume keeps it).

    The one mutable part of a request's routing, made explicit: its dispatcher
    (`flows.dispatch`) creates one per request and hands the same object to every routing
    `Attempt` of it (a resumed copy's too) and to its `Generation`; only the source opener
    (`flows.opener`) writes it; `RequestRecorder.record` reads it into the request's
    `RequestRecord`. The request's `GenerationParams` stay frozen and never carry it."""

    flow: str = ""  # "single" | "disaggregated" | "none" (refused); "": never routed
    reason: str = ""
    # the compatibility hash (model build) of its workers: once a token is generated, a resumed
    # copy continues only on workers of that hash, so one answer never mixes two model versions
    # (a retry before the first token may go to any build, and sets it anew); "": not routed yet
    compat_hash: str = ""
    queue_s: float | None = None  # arrival until it was routed (its first routing; None: never routed)


@dataclass(frozen=True)
class GenerationParams(RequestIdentity):
    prompt_ids: list[int]
    sampling: SamplingParams
    stop: tuple[str, ...]
    cache_hit_threshold: float | None = None  # decode-first; None: the router's default
    include_stop_str: bool = False  # the answer keeps the stop string or stop token that ended it (vLLM's)
    route_hint: str | None = None  # the worker the client named (X-Tandem-Worker); the pinned policy's input
    skip_special_tokens: bool = True  # the answer's text leaves special tokens out
    eos_token_id: int | None = None  # the model's end of sequence, a stop token unless ignore_eos
    tenant: Tenant = DEFAULT_TENANT  # its API key and priority, for the admission gate
    adapter: str = ""  # the model's LoRA adapter it is served with ("": the base model)
    cache_salt: str = ""  # vLLM's: its KV's chain starts from the salt's root (`block_hash.chain_root`)
    # its prompt's images, their placeholders in `prompt_ids`; every worker of the request gets
    # their bytes: a decode worker whose KV arrives whole never encodes them, one that must
    # recompute blocks that did not arrive needs them
    images: tuple[ImageInput, ...] = ()

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """The tokens that end the request when generated (the answer leaves out their text)."""
        eos = () if self.eos_token_id is None or self.sampling.ignore_eos else (self.eos_token_id,)
        return frozenset((*self.sampling.stop_token_ids, *eos))


@dataclass(frozen=True)
class TokenUsage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class RequestRecorder:
    bus: Bus
    subjects: Subjects
    metrics: RouterMetrics
    clock: Clock

    async def record(self, request: RequestIdentity, *, outcome: str, worker_id: str | None = None,
                     finish_reason: str | None = None, usage: TokenUsage | None = None,
                     ttft_s: float | None = None, span: trace.Span | None = None,
                     route: RouteNote | None = None) -> None:
        """`route`: the request's routing record (None: never routed, as a request refused
        before routing is)."""
        duration_s = self.clock() - request.arrived_at
        self.metrics.count_request(request.endpoint, outcome)
        if outcome == OUTCOME_OK:
            self.metrics.observe_e2e(duration_s, trace_exemplar(span))
        usage = usage or TokenUsage(0, 0, 0)
        self.metrics.prompt_tokens.inc(usage.prompt_tokens)
        self.metrics.cached_tokens.inc(usage.cached_tokens)
        self.metrics.completion_tokens.inc(usage.completion_tokens)
        route = route or RouteNote()
        record = RequestRecord(
            request_id=request.request_id, model=request.model, worker_id=worker_id, outcome=outcome,
            finish_reason=finish_reason, prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens,
            completion_tokens=usage.completion_tokens, ttft_s=ttft_s, duration_s=duration_s,
            flow=route.flow, reason=route.reason, queue_s=route.queue_s)
        try:
            await self.bus.client.publish(self.subjects.request_events, encode(record))
        except Exception as error:  # NATS reconnecting: the record is lost, the request is not
            log.warning("could not publish the record of %s: %s", request.request_id, error)
