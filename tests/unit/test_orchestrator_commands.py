"""Orchestrator command checks (services/orchestrator/command_checks.py), the launcher's
worker command line, and routers skipping cordoned workers: plain data."""

from __future__ import annotations

import pytest

from services.orchestrator.command_checks import refusal
from services.orchestrator.config import OrchestratorConfig, WorkerLauncherConfig, WorkerLimits
from services.orchestrator.launchers import WorkerLaunch, worker_argv
from services.router.config import RoutingConfig
from services.router.routing.eligibility import eligible
from services.router.routing.request import RouteRequest
from services.router.routing.view import WorkerView
from shared.codec import Codec, encode
from shared.config import BusConfig
from shared.schemas import WorkerCapacity, WorkerRegistration, WorkerRole, WorkerStatus
from shared.schemas import orchestrator as commands

PREFILL, DECODE, BOTH = WorkerRole.PREFILL, WorkerRole.DECODE, WorkerRole.BOTH
LIMITS = WorkerLimits()


def reg(worker_id: str, role: WorkerRole, status: WorkerStatus = WorkerStatus.ACTIVE,
        model: str = "tiny") -> WorkerRegistration:
    return WorkerRegistration(worker_id=worker_id, role=role, model=model, engine="sim", block_size=16,
                              compat_hash="abc", capacity=WorkerCapacity(kv_blocks=64, max_num_seqs=8,
                                                                         max_model_len=2048),
                              status=status, started_at=1.0, heartbeat_at=1.0)


def cluster(*registrations: WorkerRegistration) -> dict[str, WorkerRegistration]:
    return {registration.worker_id: registration for registration in registrations}


def check(command: commands.OrchestratorCommand, members, limits: WorkerLimits = LIMITS, can_launch: bool = True):
    return refusal(command, members, limits, can_launch=can_launch)


PD = cluster(reg("p1", PREFILL), reg("d1", DECODE))


@pytest.mark.parametrize("command", [commands.DrainWorker(worker_id="d1"), commands.RemoveWorker(worker_id="d1"),
                                     commands.CordonWorker(worker_id="d1"),
                                     commands.SetWorkerRole(worker_id="d1", role=PREFILL)])
def test_the_last_decode_worker_stays(command) -> None:
    why = check(command, PD)
    assert why is not None and "minimum is 1" in why


def test_force_overrides_the_minimum() -> None:
    assert check(commands.DrainWorker(worker_id="d1", force=True), PD) is None
    assert check(commands.SetWorkerRole(worker_id="d1", role=PREFILL, force=True), PD) is None


def test_a_cordoned_or_other_models_decode_worker_does_not_count() -> None:
    members = cluster(reg("d1", DECODE), reg("d2", DECODE, WorkerStatus.CORDONED), reg("d3", BOTH, model="other"))
    assert check(commands.DrainWorker(worker_id="d1"), members) is not None
    members["d2"] = reg("d2", DECODE)
    assert check(commands.DrainWorker(worker_id="d1"), members) is None


def test_prefill_workers_may_leave_and_switch_to_decode_unless_a_minimum_says_no() -> None:
    assert check(commands.DrainWorker(worker_id="p1"), PD) is None
    assert check(commands.RemoveWorker(worker_id="p1"), PD) is None
    assert check(commands.SetWorkerRole(worker_id="p1", role=DECODE), PD) is None
    keep_one = WorkerLimits(min_prefill_workers=1)
    assert "other active prefill worker(s)" in check(commands.RemoveWorker(worker_id="p1"), PD, keep_one)
    assert "minimum is 1" in check(commands.SetWorkerRole(worker_id="p1", role=DECODE), PD, keep_one)
    assert check(commands.SetWorkerRole(worker_id="p1", role=DECODE, force=True), PD, keep_one) is None


def test_set_role_refusals() -> None:
    assert "already serves as prefill" in check(commands.SetWorkerRole(worker_id="p1", role=PREFILL), PD)
    draining = cluster(reg("p1", PREFILL, WorkerStatus.DRAINING), reg("d1", DECODE))
    assert "draining" in check(commands.SetWorkerRole(worker_id="p1", role=DECODE), draining)
    capped = WorkerLimits(max_serving_workers=1)
    assert "maximum is 1" in check(commands.SetWorkerRole(worker_id="p1", role=DECODE), PD, capped)
    # decode <-> both changes no count: allowed even at the cap
    assert check(commands.SetWorkerRole(worker_id="d1", role=BOTH), PD, capped) is None


def test_commands_name_a_registered_worker() -> None:
    for command in (commands.CordonWorker(worker_id="x"), commands.UncordonWorker(worker_id="x"),
                    commands.DrainWorker(worker_id="x"), commands.RemoveWorker(worker_id="x"),
                    commands.SetWorkerRole(worker_id="x", role=DECODE)):
        assert "no registered worker named x" in check(command, PD)
    assert check(commands.ListWorkers(), {}) is None


def test_add_worker_limits() -> None:
    assert "no worker launcher" in check(commands.AddWorker(role=DECODE), PD, can_launch=False)
    assert "already registered" in check(commands.AddWorker(role=DECODE, worker_id="d1"), PD)
    assert "budget of 2" in check(commands.AddWorker(role=DECODE), PD, WorkerLimits(max_workers=2))
    assert "prefill worker(s), the maximum is 1" in check(commands.AddWorker(role=PREFILL), PD,
                                                         WorkerLimits(max_prefill_workers=1))
    assert check(commands.AddWorker(role=DECODE), PD, WorkerLimits(max_workers=3, max_prefill_workers=1)) is None


def test_commands_and_outcomes_round_trip_on_the_wire() -> None:
    codec: Codec[commands.OrchestratorCommand] = Codec(commands.OrchestratorCommand)
    for command in (commands.SetWorkerRole(worker_id="p1", role=DECODE), commands.AddWorker(role=BOTH),
                    commands.ListWorkers()):
        assert codec.decode(encode(command)) == command
    outcome = commands.CommandOutcome(outcome="refused", reason="why")
    assert Codec(commands.CommandOutcome).decode(encode(outcome)) == outcome
    assert reg("a", DECODE).generation == 0  # an older worker's registration decodes with generation 0


def test_local_launcher_starts_tandem_worker_with_the_orchestrators_bus() -> None:
    config = OrchestratorConfig(bus=BusConfig(nats_url="nats://h:1", namespace="ns"),
                                launcher=WorkerLauncherConfig(kind="local", model_dir="/m", worker_args=("--x", "1")))
    argv = worker_argv(config, WorkerLaunch(worker_id="d9", role=DECODE))
    assert argv[1:4] == ["-m", "cli.main", "worker"]
    joined = " ".join(argv)
    assert "--nats-url nats://h:1 --namespace ns" in joined and "--worker-id d9 --role decode" in joined
    assert "--model-dir /m" in joined and argv[-2:] == ["--x", "1"]


def view(worker_id: str, role: WorkerRole, status: WorkerStatus) -> WorkerView:
    return WorkerView(worker_id=worker_id, model="m", role=role, status=status, max_num_seqs=8, max_model_len=1024,
                      reported_load=0, in_flight=0, in_flight_at_report=0, last_routed=0, compat_hash="h")


def test_routers_skip_cordoned_and_draining_workers() -> None:
    workers = [view("d1", DECODE, WorkerStatus.CORDONED), view("d2", DECODE, WorkerStatus.ACTIVE),
               view("p1", PREFILL, WorkerStatus.DRAINING), view("p2", PREFILL, WorkerStatus.ACTIVE)]
    result = eligible(workers, RouteRequest(model="m", prompt_tokens=10, total_tokens=20), RoutingConfig())
    assert [w.worker_id for w in result.serving] == ["d2"] and [w.worker_id for w in result.prefill] == ["p2"]
