"""Scale to zero's pure policy on plain data: the router's holding of a scalable model's
requests (`routing.cold_start`: a bounded queue, a deadline from arrival, when to ask for a
worker) and the orchestrator's idle models (`idle_models`: activity, first workers, idle time)."""

from __future__ import annotations

import pytest

from services.orchestrator.command_checks import refusal
from services.orchestrator.config import OrchestratorConfig, ScaleToZeroConfig, WorkerLauncherConfig, WorkerLimits
from services.orchestrator.idle_models import IdleModel, IdleModels
from services.router.config import ScaleFromZeroConfig
from services.router.routing.cold_start import ColdStarts, Hold, HoldRefused
from shared.config import ConfigError
from shared.scalable_models import ScalableModel
from shared.schemas.orchestrator import OrchestratorCommand, WakeModel


def cold_starts(max_held: int = 2) -> ColdStarts:
    return ColdStarts(models=frozenset({"small"}), max_held=max_held, hold_s=30.0, ask_every_s=10.0)


def test_only_listed_models_are_scalable() -> None:
    policy = cold_starts()
    assert policy.scalable("small") and not policy.scalable("tiny")


def test_a_held_request_waits_until_its_arrival_plus_the_hold_time() -> None:
    assert cold_starts().hold("small", arrived_at=100.0) == Hold(deadline=130.0)


def test_the_queue_is_bounded_per_model_and_a_release_makes_room() -> None:
    policy = cold_starts(max_held=2)
    assert isinstance(policy.hold("small", 0.0), Hold)
    assert isinstance(policy.hold("small", 0.0), Hold)
    refused = policy.hold("small", 0.0)
    assert isinstance(refused, HoldRefused) and "2 requests" in refused.reason
    policy.release("small", routed=False)
    assert policy.held("small") == 1
    assert isinstance(policy.hold("small", 1.0), Hold)


def test_the_first_hold_asks_for_a_worker_and_asks_again_only_after_the_period() -> None:
    policy = cold_starts()
    policy.hold("small", 0.0)
    assert policy.should_ask("small", 0.0)
    assert not policy.should_ask("small", 5.0)  # the other held requests share the ask
    assert policy.should_ask("small", 10.0)  # the start failed, or its worker left: ask again


def test_once_a_held_request_is_routed_the_next_time_at_zero_asks_at_once() -> None:
    policy = cold_starts()
    policy.hold("small", 0.0)
    assert policy.should_ask("small", 0.0)
    policy.release("small", routed=True)
    assert policy.held("small") == 0
    policy.hold("small", 3.0)  # scaled down meanwhile
    assert policy.should_ask("small", 3.0)


def test_a_failed_request_leaves_the_ask_in_place() -> None:
    policy = cold_starts()
    policy.hold("small", 0.0)
    assert policy.should_ask("small", 0.0)
    policy.release("small", routed=False)
    policy.hold("small", 1.0)
    assert not policy.should_ask("small", 1.0)


def test_a_model_is_idle_after_the_idle_time_without_activity() -> None:
    models = IdleModels(models={"small"}, idle_s=5.0)
    workers = {"small": ["small-1"]}
    assert models.idle(workers, now=0.0) == []  # first seen with workers: active now
    models.active("small", 3.0)  # a request
    assert models.idle(workers, now=7.9) == []
    assert models.idle(workers, now=8.0) == [IdleModel(model="small", worker_ids=("small-1",), idle_for_s=5.0)]


def test_only_scalable_models_with_stoppable_workers_are_ever_idle() -> None:
    models = IdleModels(models={"small"}, idle_s=5.0)
    assert models.idle({"tiny": ["w1"], "small": []}, now=0.0) == []
    assert models.idle({"tiny": ["w1"], "small": []}, now=100.0) == []
    models.active("tiny", 1.0)  # not scalable: not tracked
    assert models.last_active("tiny") is None


def test_a_new_worker_gets_a_full_idle_period_whatever_activity_came_before() -> None:
    models = IdleModels(models={"small"}, idle_s=5.0)
    models.active("small", 0.0)  # a late record of the model's past
    assert models.idle({}, now=20.0) == []  # no worker
    assert models.idle({"small": ["small-2"]}, now=20.0) == []  # its first worker since: active now
    assert models.idle({"small": ["small-2"]}, now=24.9) == []
    assert [idle.model for idle in models.idle({"small": ["small-2"]}, now=25.0)] == ["small"]


def test_no_idle_time_means_never_idle() -> None:
    models = IdleModels(models={"small"}, idle_s=0.0)
    assert models.idle({"small": ["small-1"]}, now=0.0) == []
    assert models.idle({"small": ["small-1"]}, now=1e6) == []


def test_activity_never_goes_back_in_time() -> None:
    models = IdleModels(models={"small"}, idle_s=5.0)
    models.active("small", 10.0)
    models.active("small", 4.0)  # a record that arrived late
    assert models.last_active("small") == 10.0


def test_a_wake_is_refused_without_a_launcher_or_past_the_budget() -> None:
    assert "no worker launcher" in refusal(WakeModel(model="small"), {}, WorkerLimits(), can_launch=False)
    assert refusal(WakeModel(model="small"), {}, WorkerLimits(max_workers=1), can_launch=True) is None


def test_scalable_models_are_name_equals_directory_and_need_a_launcher() -> None:
    assert ScaleFromZeroConfig(models=("small=/models/small",)).directories() == {"small": "/models/small"}
    assert ScaleToZeroConfig(models=("a=/m/a", "b=/m/b")).scalable() == {
        "a": ScalableModel(name="a", directory="/m/a"), "b": ScalableModel(name="b", directory="/m/b")}
    with pytest.raises(ConfigError, match="NAME=DIR"):
        ScaleFromZeroConfig(models=("small",)).validate()
    with pytest.raises(ConfigError, match="launcher"):
        OrchestratorConfig(scale_to_zero=ScaleToZeroConfig(models=("small=/m/small",))).validate()
    OrchestratorConfig(launcher=WorkerLauncherConfig(kind="local", model_dir="/m/tiny"),
                       scale_to_zero=ScaleToZeroConfig(models=("small=/m/small",), idle_s=60)).validate()


def test_the_wake_command_travels_in_the_command_union() -> None:
    import msgspec

    assert msgspec.msgpack.decode(msgspec.msgpack.encode(WakeModel(model="small")),
                                  type=OrchestratorCommand) == WakeModel(model="small")
