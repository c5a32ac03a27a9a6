"""The rolling upgrade's planner (services/orchestrator/upgrade_plan.py) on plain data: the
steps' order, the invariant that no version ever serves with one paired role but not the
other, the budget, and the command's wire form and launcher flags."""

from __future__ import annotations

import pytest

from services.orchestrator.command_checks import refusal
from services.orchestrator.config import OrchestratorConfig, WorkerLauncherConfig, WorkerLimits
from services.orchestrator.launchers import WorkerLaunch, worker_argv
from services.orchestrator.upgrade_plan import (
    AddStep,
    CordonStep,
    CurrentWorker,
    DrainStep,
    UpgradePlan,
    WaitActiveStep,
    plan_upgrade,
)
from shared.codec import Codec, encode
from shared.schemas import WorkerRole, WorkerStatus
from shared.schemas.orchestrator import CommandOutcome, CommandProgress, OrchestratorCommand, UpgradeWorkers

PREFILL, DECODE, BOTH = WorkerRole.PREFILL, WorkerRole.DECODE, WorkerRole.BOTH
NO_BUDGET = WorkerLimits()


def workers(prefill: int, decode: int, both: int = 0, version: str = "v1", model: str = "tiny",
            ) -> list[CurrentWorker]:
    shape = [(PREFILL, "p", prefill), (DECODE, "d", decode), (BOTH, "b", both)]
    return [CurrentWorker(worker_id=f"{stem}{i + 1}-{version}", role=role, model=model, version=version)
            for role, stem, count in shape for i in range(count)]


def planned(current: list[CurrentWorker], version: str = "v2", limits: WorkerLimits = NO_BUDGET,
            **kwargs) -> UpgradePlan:
    plan = plan_upgrade(current, version, limits, **kwargs)
    assert isinstance(plan, UpgradePlan), plan
    return plan


def replay(current: list[CurrentWorker], plan: UpgradePlan) -> list[dict[str, tuple[WorkerRole, str, bool]]]:
    """The cluster after each step: worker id -> (role, version, active). A new worker is
    active from its wait step on, a cordoned one no more; a drained one is gone."""
    cluster = {w.worker_id: (w.role, w.version, True) for w in current}
    states = []
    for step in plan.steps:
        match step:
            case AddStep(worker_id=worker_id, role=role):
                assert worker_id not in cluster
                cluster[worker_id] = (role, plan.version, False)
            case WaitActiveStep(worker_ids=ids):
                for worker_id in ids:
                    role, version, _ = cluster[worker_id]
                    cluster[worker_id] = (role, version, True)
            case CordonStep(worker_ids=ids):
                for worker_id in ids:
                    role, version, _ = cluster[worker_id]
                    cluster[worker_id] = (role, version, False)
            case DrainStep(worker_ids=ids):
                for worker_id in ids:
                    del cluster[worker_id]
        states.append(dict(cluster))
    return states


def serving_roles(state: dict[str, tuple[WorkerRole, str, bool]], version: str) -> set[WorkerRole]:
    return {role for role, v, active in state.values() if v == version and active}


def test_one_pair_is_add_both_wait_cordon_both_then_drain_prefill_then_decode() -> None:
    plan = planned(workers(1, 1))
    assert plan.describe() == ["add prefill prefill-v2-1", "add decode decode-v2-1",
                               "wait until prefill-v2-1, decode-v2-1 active", "cordon p1-v1, d1-v1",
                               "drain p1-v1", "drain d1-v1"]
    assert plan.extra_workers == 2


@pytest.mark.parametrize(("prefill", "decode", "both"),
                         [(1, 1, 0), (2, 2, 0), (1, 3, 0), (3, 1, 0), (2, 3, 0), (0, 2, 0), (2, 0, 0),
                          (0, 0, 2), (1, 2, 1)])
def test_no_version_serves_with_one_paired_role_missing(prefill: int, decode: int, both: int) -> None:
    current = workers(prefill, decode, both)
    plan = planned(current)
    states = replay(current, plan)
    start = len(current)
    for state in states:
        assert len(state) - start <= plan.extra_workers
        assert plan.extra_workers <= 2
        for version in ("v1", "v2"):
            roles = serving_roles(state, version) & {PREFILL, DECODE}
            if prefill and decode:  # a version that had both keeps both or neither
                assert roles in (set(), {PREFILL, DECODE}), (version, state)
    # One for one, and at the end only the new version.
    final = states[-1]
    assert all(version == "v2" for _, version, _ in final.values())
    assert sorted(role.value for role, _, _ in final.values()) == sorted(w.role.value for w in current)
    # Something serves at every point: a v1 or a v2 worker that decodes (paired or alone).
    for state in states if decode or both else ():
        assert any(role is not PREFILL and active for role, _, active in state.values())


def test_uneven_roles_keep_the_last_of_each_for_the_last_round() -> None:
    plan = planned(workers(1, 3))
    drains = [step.worker_ids for step in plan.steps if isinstance(step, DrainStep)]
    assert drains == [("d1-v1",), ("d2-v1",), ("p1-v1",), ("d3-v1",)]
    assert [step.worker_ids for step in plan.steps if isinstance(step, CordonStep)] == [("p1-v1", "d3-v1")]
    first_adds = [step.role for step in plan.steps[:2]]
    assert first_adds == [PREFILL, DECODE]  # the new version gets both roles before anything drains


def test_budget() -> None:
    current = workers(1, 1)
    at_budget = plan_upgrade(current, "v2", WorkerLimits(max_workers=2))
    assert isinstance(at_budget, str) and "budget of 2" in at_budget and "at least one extra" in at_budget
    one_spare = plan_upgrade(current, "v2", WorkerLimits(max_workers=3))
    assert isinstance(one_spare, str) and "room for 2 extra workers" in one_spare
    assert planned(current, limits=WorkerLimits(max_workers=4)).extra_workers == 2
    # Workers of one role only need one spare place.
    assert planned(workers(0, 2), limits=WorkerLimits(max_workers=3)).extra_workers == 1
    # The per-role maxima leave no room for a new worker beside the old one.
    full_prefill = plan_upgrade(current, "v2", WorkerLimits(max_prefill_workers=1))
    assert isinstance(full_prefill, str) and "prefill" in full_prefill
    full_decode = plan_upgrade(current, "v2", WorkerLimits(max_serving_workers=1))
    assert isinstance(full_decode, str) and "decode" in full_decode


def test_only_old_workers_of_the_model_are_replaced() -> None:
    assert planned(workers(1, 1, version="v2")).steps == ()
    half_done = [*workers(1, 1, version="v2"), *workers(0, 1)]
    plan = planned(half_done)
    assert plan.describe() == ["add decode decode-v2-1", "wait until decode-v2-1 active", "drain d1-v1"]
    draining = [CurrentWorker(worker_id="d9", role=DECODE, model="tiny", version="v1",
                              status=WorkerStatus.DRAINING), *workers(1, 1)]
    assert "d9" not in str(planned(draining).describe())
    two_models = [*workers(1, 1), *workers(1, 1, model="other")]
    refused = plan_upgrade(two_models, "v2", NO_BUDGET)
    assert isinstance(refused, str) and "several models" in refused
    assert planned(two_models, model="other").model == "other"
    assert plan_upgrade(workers(1, 1), "", NO_BUDGET) == "name the version to upgrade to"


def test_new_names_are_fresh_and_fit_a_subject() -> None:
    current = [*workers(1, 1), CurrentWorker(worker_id="prefill-v2_1-1", role=PREFILL, model="tiny",
                                             version="v0")]
    names = [step.worker_id for step in planned(current, version="v2.1").steps if isinstance(step, AddStep)]
    assert names == ["prefill-v2_1-2", "decode-v2_1-1", "prefill-v2_1-3"]


def test_upgrade_command_on_the_wire_and_in_the_launcher() -> None:
    command = UpgradeWorkers(model_version="v2", worker_args=["--kv-blocks", "128"],
                             role_args={"decode": ["--max-num-seqs", "4"]})
    assert Codec(OrchestratorCommand).decode(encode(command)) == command
    outcome = CommandOutcome(outcome="ok", steps=["add prefill prefill-v2-1"])
    assert Codec(CommandOutcome).decode(encode(outcome)) == outcome
    progress = CommandProgress(command="upgrade_workers", index=1, total=4, step="add", outcome="ok")
    assert Codec(CommandProgress).decode(encode(progress)) == progress
    assert refusal(command, {}, NO_BUDGET, can_launch=False) is not None
    assert refusal(command, {}, NO_BUDGET, can_launch=True) is None
    config = OrchestratorConfig(launcher=WorkerLauncherConfig(kind="local", model_dir="/m",
                                                              worker_args=("--model-version", "v1")))
    argv = worker_argv(config, WorkerLaunch(worker_id="d", role=DECODE, extra_args=("--model-version", "v2")))
    assert argv[-4:] == ["--model-version", "v1", "--model-version", "v2"]  # the later one wins
