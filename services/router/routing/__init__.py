"""Routing: which worker(s) serve a request, and how its prompt's KV moves. Pure and synchronous.

No I/O and no clock anywhere in this package: the router's adapters (`fleet.worker_pool`,
`kv.view`, `flows.dispatch`) feed it plain data and act on its answers.

One request goes through `decide()` in stages:
1. eligibility (`eligibility`): which workers may take it at all, and admission control;
2. scoring (`candidates`, `cost`): what each candidate flow would cost, computed lazily;
3. picking: the configured policy (`policy` is the contract; `policies/` one module each,
   listed by name in `registry`) selects one worker or a (prefill, decode) pair;
4. the plan (`plan`): the selected workers, the prompt's KV plan (held, pulled from a
   holder, computed) and, for a decode part, whether its KV is pulled or pushed. The
   router's one flow executor (`services.router.flows.executor`) runs any plan.

Beside it, `ledger` is the predicted-load account the worker pool keeps per worker (route,
first token, finish), `view` the `WorkerView` every stage reads, and `placement/` the
prefixes' placement (which worker a prefix goes back to, which prefixes stay resident): a
`Placement` per model that the routing state (`flows.routing_state`) holds, snapshots into each `RouteRequest` and
records each committed plan in.
"""

from services.router.routing.decide import decide
from services.router.routing.eligibility import can_serve, context_limit
from services.router.routing.plan import (
    Flow,
    KvTransferMode,
    RoutePlan,
    RouteReason,
    Selection,
    build_plan,
    kv_transfer_mode,
)
from services.router.routing.policy import PolicySpec, RoutingPolicy
from services.router.routing.registry import build_policy, policy_names, policy_spec
from services.router.routing.request import RefusalReason, RouteRefusal, RouteRequest
from services.router.routing.view import WorkerView

__all__ = ["Flow", "KvTransferMode", "PolicySpec", "RefusalReason", "RoutePlan", "RouteReason", "RouteRefusal",
           "RouteRequest", "RoutingPolicy", "Selection", "WorkerView", "build_plan", "build_policy", "can_serve", "context_limit", "decide",
           "kv_transfer_mode", "policy_names", "policy_spec"]
