"""The routing policy registry: every policy by name, an unknown name refused at router start
with the registered names, and a new policy is one spec plugged in beside the others."""

from __future__ import annotations

import pytest

from services.router.config import RouterConfig, RoutingConfig
from services.router.main import router_app
from services.router.routing import (
    RoutePlan,
    RouteRequest,
    Selection,
    decide,
    policy_names,
    policy_spec,
    registry,
)
from services.router.routing.candidates import Candidates
from services.router.routing.policy import PolicySpec
from shared.config import ConfigError
from tests.unit.worker_views import worker_view

worker = worker_view


def test_the_registered_policies() -> None:
    assert policy_names() == ["kv-aware", "round-robin", "random", "pinned"]
    for name in policy_names():
        spec = policy_spec(name)
        assert spec.name == name and spec.summary
        assert hasattr(spec.build(RoutingConfig(policy=name)), "select")


def test_an_unknown_policy_is_refused_with_the_registered_names() -> None:
    RoutingConfig(policy="teleport").validate()  # the config holds a name; the registry judges it
    with pytest.raises(ConfigError, match="unknown routing policy 'teleport'.*kv-aware, round-robin, random"):
        policy_spec("teleport")
    with pytest.raises(ConfigError, match="teleport"):  # the router refuses to start with it
        router_app(RouterConfig(model_dir="unused", routing=RoutingConfig(policy="teleport")))
    with pytest.raises(ConfigError):
        RoutingConfig(policy="").validate()


class _Heaviest:
    """A policy for the test: the most loaded serving worker."""

    def select(self, candidates: Candidates) -> Selection:
        return Selection("baseline", max(candidates.eligible.serving, key=lambda view: view.reported_load or 0))


def test_a_new_policy_is_one_spec_in_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = PolicySpec("heaviest", "the most loaded worker", lambda routing: _Heaviest())
    monkeypatch.setattr(registry, "POLICIES", (*registry.POLICIES, spec))
    assert "heaviest" in policy_names()
    workers = [worker("a", reported_load=1), worker("b", reported_load=5), worker("c", reported_load=3)]
    plan = decide(workers, RouteRequest(model="m", prompt_tokens=100, total_tokens=110), RoutingConfig(policy="heaviest"))
    assert isinstance(plan, RoutePlan) and (plan.flow, plan.reason, plan.worker_id) == ("single", "baseline", "b")
