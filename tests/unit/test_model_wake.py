"""A disaggregated scalable model (`NAME=DIR@<P>p<D>d`): the one parser the router and the
orchestrator share (`shared.scalable_models`), the router's wait for the prefill worker
(`routing.cold_start.awaits_prefill`), and the orchestrator's wake of its prefill and decode
workers (`model_wake`, run by the real `ControlPlane` with an in-memory launcher and members
bucket): both start together, concurrent wakes share the start, and when one start fails the
other worker is drained and stopped again."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import pytest

from services.orchestrator.config import OrchestratorConfig, ScaleToZeroConfig, WorkerLauncherConfig, WorkerLimits
from services.orchestrator.control_plane import ControlPlane
from services.orchestrator.launchers import LaunchedWorker, LaunchError, WorkerLaunch
from services.orchestrator.model_wake import missing_roles
from services.router.config import ScaleFromZeroConfig
from services.router.routing.cold_start import ColdStarts
from services.router.routing.view import WorkerView
from shared.codec import MalformedCounter, encode
from shared.config import ConfigError
from shared.scalable_models import ScalableModel, scalable_model, scalable_models
from shared.schemas import ControlReply, WorkerCapacity, WorkerRegistration, WorkerRole, WorkerStatus
from shared.schemas.orchestrator import WakeModel

PREFILL, DECODE, BOTH = WorkerRole.PREFILL, WorkerRole.DECODE, WorkerRole.BOTH
ACTIVE = WorkerStatus.ACTIVE


# ---- the parser ------------------------------------------------------------------------

def test_name_equals_directory_is_one_worker_of_role_both() -> None:
    model = scalable_model("small=/models/small")
    assert model == ScalableModel(name="small", directory="/models/small")
    assert not model.disaggregated and model.roles() == (BOTH,)


def test_a_shape_after_the_directory_wakes_prefill_and_decode_workers() -> None:
    model = scalable_model("small=/models/small@1p1d")
    assert model == ScalableModel(name="small", directory="/models/small", prefill_workers=1, decode_workers=1)
    assert model.disaggregated and model.roles() == (PREFILL, DECODE)
    assert scalable_model("big=/m/big@2p3d").roles() == (PREFILL, PREFILL, DECODE, DECODE, DECODE)


def test_an_at_sign_that_is_no_shape_belongs_to_the_directory() -> None:
    assert scalable_model("odd=/m/v@2").directory == "/m/v@2"
    assert scalable_model("odd=/m/a@b@1p1d") == ScalableModel(name="odd", directory="/m/a@b", prefill_workers=1,
                                                              decode_workers=1)


@pytest.mark.parametrize("entry", ["small", "=/m/small", "small=", "small=@1p1d"])
def test_malformed_entries_are_config_errors(entry: str) -> None:
    with pytest.raises(ConfigError, match="scalable model"):
        scalable_model(entry)


def test_a_name_given_twice_is_a_config_error_in_both_services() -> None:
    with pytest.raises(ConfigError, match="given twice"):
        scalable_models(["a=/m/a", "a=/m/b@1p1d"])
    with pytest.raises(ConfigError, match="given twice"):
        ScaleFromZeroConfig(models=("a=/m/a", "a=/m/a")).validate()
    with pytest.raises(ConfigError, match="given twice"):
        ScaleToZeroConfig(models=("a=/m/a", "a=/m/a")).validate()


def test_the_router_and_the_orchestrator_read_the_same_models() -> None:
    entries = ("pd=/m/pd@1p1d", "one=/m/one")
    assert ScaleFromZeroConfig(models=entries).scalable() == ScaleToZeroConfig(models=entries).scalable()
    assert ScaleFromZeroConfig(models=entries).directories() == {"pd": "/m/pd", "one": "/m/one"}


# ---- the router: a held request waits for the prefill worker ---------------------------

def view(worker_id: str, role: WorkerRole, model: str = "pd", status: WorkerStatus = ACTIVE) -> WorkerView:
    return WorkerView(worker_id=worker_id, model=model, role=role, status=status, max_num_seqs=8, max_model_len=1024,
                      reported_load=0, in_flight=0, in_flight_at_report=0, last_routed=0, compat_hash="h")


def test_a_held_request_of_a_pd_model_waits_for_its_prefill_worker_while_the_wake_runs() -> None:
    policy = ColdStarts.of(ScaleFromZeroConfig(models=("pd=/m/pd@1p1d", "one=/m/one")))
    decode_only = [view("d", DECODE), view("p-other", PREFILL, model="other")]
    assert policy.awaits_prefill("pd", decode_only, whole=True, waking=True)
    assert not policy.awaits_prefill("pd", decode_only, whole=True, waking=False)  # the wake answered
    assert not policy.awaits_prefill("pd", [*decode_only, view("p", PREFILL)], whole=True, waking=True)
    assert policy.awaits_prefill("pd", [*decode_only, view("p", PREFILL, status=WorkerStatus.DRAINING)],
                                 whole=True, waking=True)
    assert not policy.awaits_prefill("pd", decode_only, whole=False, waking=True)
    assert not policy.awaits_prefill("one", [view("b", BOTH, model="one")], whole=True, waking=True)


# ---- the orchestrator: the two-worker wake ---------------------------------------------

def registration(worker_id: str, role: WorkerRole, model: str) -> WorkerRegistration:
    return WorkerRegistration(worker_id=worker_id, role=role, model=model, engine="sim", block_size=16,
                              compat_hash="abc", capacity=WorkerCapacity(kv_blocks=64, max_num_seqs=8,
                                                                         max_model_len=2048),
                              status=ACTIVE, started_at=1.0, heartbeat_at=1.0)


class InMemoryCluster:
    """The launcher and the members bucket at once: a started worker registers ACTIVE after
    `register_after_s`, unless its role is in `failing` (the launch raises) or `exiting` (its
    process exits before registering); a drained worker deregisters."""

    def __init__(self, failing: frozenset[WorkerRole] = frozenset(), exiting: frozenset[WorkerRole] = frozenset(),
                 register_after_s: float = 0.05) -> None:
        self.members: dict[str, WorkerRegistration] = {}
        self.failing, self.exiting, self.register_after_s = failing, exiting, register_after_s
        self.started: list[WorkerLaunch] = []
        self.running: set[str] = set()
        self.control: ControlPlane | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def change(self) -> None:
        assert self.control is not None
        self.control.member_changed()

    async def start_worker(self, spec: WorkerLaunch) -> LaunchedWorker:
        self.started.append(spec)
        if spec.role in self.failing:
            raise LaunchError(f"no room for a {spec.role.value} worker")
        self.running.add(spec.worker_id)
        if spec.role in self.exiting:
            self.running.discard(spec.worker_id)
        else:
            model = spec.extra_args[spec.extra_args.index("--served-model-name") + 1]
            task = asyncio.create_task(self._register(spec.worker_id, spec.role, model))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return LaunchedWorker(worker_id=spec.worker_id, role=spec.role, pid=os.getpid())

    async def _register(self, worker_id: str, role: WorkerRole, model: str) -> None:
        await asyncio.sleep(self.register_after_s)  # the process's start-up, simulated
        if worker_id in self.running:
            self.members[worker_id] = registration(worker_id, role, model)
            self.change()

    async def stop_worker(self, handle: LaunchedWorker, timeout_s: float) -> int | None:
        self.running.discard(handle.worker_id)
        self.members.pop(handle.worker_id, None)
        self.change()
        return 0

    def alive(self, handle: LaunchedWorker) -> bool:
        return handle.worker_id in self.running

    async def log_tail(self, handle: LaunchedWorker, lines: int = 20) -> str:
        return "(its log)"

    async def request(self, subject: str, data: bytes, timeout: float) -> SimpleNamespace:
        """The bus client's request: every control message is a `Drain` here; the worker leaves."""
        worker_id = subject.split(".")[-2]
        self.members.pop(worker_id, None)
        asyncio.get_running_loop().call_soon(self.change)
        return SimpleNamespace(data=encode(ControlReply(outcome="applied", role=DECODE, status=WorkerStatus.DRAINING,
                                                        generation=1)))


def control_plane(cluster: InMemoryCluster, limits: WorkerLimits = WorkerLimits()) -> ControlPlane:
    config = OrchestratorConfig(
        command_timeout_s=1.0, limits=limits,
        launcher=WorkerLauncherConfig(kind="local", model_dir="/m/tiny", start_timeout_s=2.0),
        scale_to_zero=ScaleToZeroConfig(models=("pd=/m/pd@1p1d", "one=/m/one"), drain_deadline_s=1.0))
    config.validate()
    bus = SimpleNamespace(client=SimpleNamespace(request=cluster.request))
    control = ControlPlane(config, bus, lambda: cluster.members, cluster, MalformedCounter())  # type: ignore[arg-type]
    cluster.control = control
    return control


async def test_a_pd_wake_starts_a_prefill_and_a_decode_worker_together_and_is_done_when_both_are_active() -> None:
    cluster = InMemoryCluster()
    control = control_plane(cluster)
    first, second = await asyncio.gather(control.execute(WakeModel(model="pd")), control.execute(WakeModel(model="pd")))
    assert first == second and first.ok, first  # the concurrent wakes shared one start
    assert sorted(spec.role.value for spec in cluster.started) == ["decode", "prefill"]
    for spec in cluster.started:
        assert spec.extra_args == ("--model-dir", "/m/pd", "--served-model-name", "pd")
    assert sorted(summary.registration.role.value for summary in first.workers) == ["decode", "prefill"]
    assert {registration.role for registration in cluster.members.values()} == {PREFILL, DECODE}
    assert sorted(control.launched()) == sorted(spec.worker_id for spec in cluster.started)
    again = await control.execute(WakeModel(model="pd"))
    assert again.ok and "active prefill and decode workers" in again.reason and len(cluster.started) == 2


async def test_a_wake_starts_only_the_workers_a_model_lacks() -> None:
    cluster = InMemoryCluster()
    cluster.members["pd-decode-old"] = registration("pd-decode-old", DECODE, "pd")
    outcome = await control_plane(cluster).execute(WakeModel(model="pd"))
    assert outcome.ok and [spec.role for spec in cluster.started] == [PREFILL]
    assert missing_roles(scalable_model("pd=/m/pd@1p1d"), cluster.members) == []


async def test_a_model_without_a_shape_still_wakes_as_one_worker_of_role_both() -> None:
    cluster = InMemoryCluster()
    outcome = await control_plane(cluster).execute(WakeModel(model="one"))
    assert outcome.ok and [spec.role for spec in cluster.started] == [BOTH]


@pytest.mark.parametrize("failing, exiting, why", [({PREFILL}, set(), "no room for a prefill worker"),
                                                   (set(), {DECODE}, "exited")])
async def test_when_one_start_fails_the_other_worker_is_stopped_and_the_wake_fails(failing, exiting, why) -> None:
    cluster = InMemoryCluster(failing=frozenset(failing), exiting=frozenset(exiting))
    control = control_plane(cluster)
    outcome = await control.execute(WakeModel(model="pd"))
    assert outcome.outcome == "failed" and why in outcome.reason, outcome
    assert "stopped again" in outcome.reason, outcome.reason
    assert cluster.members == {} and cluster.running == set() and control.launched() == []


async def test_a_pd_wake_past_a_role_budget_is_refused_before_anything_starts() -> None:
    cluster = InMemoryCluster()
    outcome = await control_plane(cluster, WorkerLimits(max_workers=1)).execute(WakeModel(model="pd"))
    assert outcome.outcome == "refused" and "budget" in outcome.reason and cluster.started == []
    cluster = InMemoryCluster()
    cluster.members["p-other"] = registration("p-other", PREFILL, "other")
    outcome = await control_plane(cluster, WorkerLimits(max_prefill_workers=1)).execute(WakeModel(model="pd"))
    assert outcome.outcome == "refused" and "prefill worker(s)" in outcome.reason and cluster.started == []
