"""The policy registry: every routing policy, registered once by name.

A policy module under `policies/` exports one `PolicySpec`; `POLICIES` lists it with one
line. The router builds its policy through `build_policy(routing)` when it starts (an
unknown `RoutingConfig.policy` fails then, with the registered names); help texts list
`policy_names()`.
"""

from __future__ import annotations

from services.router.routing.config import RoutingConfig
from services.router.routing.policies.kv_aware import KV_AWARE
from services.router.routing.policies.pinned import PINNED
from services.router.routing.policies.random_pick import RANDOM
from services.router.routing.policies.round_robin import ROUND_ROBIN
from services.router.routing.policy import PolicySpec, RoutingPolicy
from shared.config import ConfigError

POLICIES: tuple[PolicySpec, ...] = (
    KV_AWARE,
    ROUND_ROBIN,
    RANDOM,
    PINNED,
)


def policy_names() -> list[str]:
    return [spec.name for spec in POLICIES]


def policy_spec(name: str) -> PolicySpec:
    for spec in POLICIES:
        if spec.name == name:
            return spec
    raise ConfigError(f"unknown routing policy {name!r} (registered: {', '.join(policy_names())})")


def build_policy(routing: RoutingConfig) -> RoutingPolicy:
    return policy_spec(routing.policy).build(routing)
