"""The contract of a routing policy, the picking stage of routing.

A policy is pure and synchronous: `select(candidates)` gets the request's eligible workers
and their costs (`Candidates`, built by `decide()` after the eligibility stage) and answers
a `Selection` (one worker, or a prefill and a decode worker, with a reason), or a
`RouteRefusal`. It never touches I/O or a clock; what it needs to know about the past (the
router's last pick per worker, a random draw) comes in the views and the request.

Each policy is described once by a `PolicySpec` in its own module under `policies/` and
listed in `registry` with one line; `RoutingConfig.policy` names it, and the router checks
the name against the registry when it starts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from services.router.routing.candidates import Candidates
from services.router.routing.config import RoutingConfig
from services.router.routing.plan import Selection
from services.router.routing.request import RouteRefusal


class RoutingPolicy(Protocol):
    def select(self, candidates: Candidates) -> Selection | RouteRefusal: ...


@dataclass(frozen=True, slots=True)
class PolicySpec:
    name: str  # the value of `RoutingConfig.policy` (and the router's `--routing-policy`)
    summary: str  # one line for help texts
    build: Callable[[RoutingConfig], RoutingPolicy]
