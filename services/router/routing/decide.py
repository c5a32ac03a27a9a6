"""Routing one request: eligibility -> scoring -> the policy's pick -> the plan.

Pure and synchronous; the routing state (`flows.routing_state`) calls `decide()` with `WorkerPool.views()` and, per
worker, how much of the prompt the KV index says it holds (in the `RouteRequest`), then
commits the plan with no await in between. The answer is a `RoutePlan`, a `RouteRefusal`
("overloaded": every candidate is past its queue limit; "cache_threshold": decode-first and
no worker holds enough of the prompt), or None (no worker can take the request now: the
caller waits).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from services.router.routing.candidates import Candidates
from services.router.routing.config import RoutingConfig
from services.router.routing.eligibility import Eligible, eligible
from services.router.routing.plan import RoutePlan, build_plan
from services.router.routing.policy import RoutingPolicy
from services.router.routing.registry import build_policy
from services.router.routing.request import RouteRefusal, RouteRequest
from services.router.routing.view import WorkerView

DEFAULT_ROUTING = RoutingConfig()


def decide(workers: Sequence[WorkerView], request: RouteRequest, routing: RoutingConfig = DEFAULT_ROUTING,
           policy: RoutingPolicy | None = None) -> RoutePlan | RouteRefusal | None:
    """How to serve `request` now; a refusal; or None when no worker can (the caller waits).
    `policy` defaults to the one `routing.policy` names."""
    allowed = eligible(workers, request, routing)
    if not isinstance(allowed, Eligible):
        return allowed
    if request.one_engine:
        allowed = dataclasses.replace(allowed, prefill=[], prefill_exists=False)
    candidates = Candidates(workers, request, routing, allowed)
    if policy is None:
        policy = build_policy(routing)
    selection = policy.select(candidates)
    if isinstance(selection, RouteRefusal):
        return selection
    if request.one_engine and selection.reason == "no_prefill_worker":  # not a baseline's or a threshold's pick
        selection = dataclasses.replace(selection, reason="one_engine_sampling")
    return build_plan(selection, candidates)
