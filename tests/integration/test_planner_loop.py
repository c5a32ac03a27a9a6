"""The SLO planner running in the orchestrator, against a real nats-server with the
orchestrator and three sim workers (two prefill, one decode) in this process.

The load makes decode the bottleneck: long generations fill the decode worker's batch
(occupancy over its target) while the prefill workers idle. With short sustain and cooldown
settings the planner switches a prefill worker to decode (its decision event says why, and
the worker's registration changes); in dry run it publishes the same decision and changes
nothing."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence

from services.orchestrator.config import (
    OrchestratorConfig,
    PlannerLoopConfig,
    ScaleToZeroConfig,
    WorkerLauncherConfig,
)
from services.orchestrator.service import OrchestratorService
from services.worker.service import WorkerService
from shared.bus import Bus, connect
from shared.codec import Codec, encode
from shared.config import BusConfig, MembershipConfig, WorkerConfig
from shared.request_plane import ResponseStream, open_stream
from shared.schemas import GenerateRequest, RequestRecord, SamplingParams, WorkerRole
from shared.schemas.orchestrator import CommandOutcome, CordonWorker, UncordonWorker
from shared.schemas.planner import PlannerDecision, ScaleDown, ScaleUp, SwitchRole
from tests.integration.sim_workers import start_sim_worker
from tests.waiting import wait_for

MEMBERSHIP = MembershipConfig(heartbeat_interval_s=0.1, ttl_s=1.0)
DECODE_SLOTS = 4
decisions: Codec[PlannerDecision] = Codec(PlannerDecision)
outcomes: Codec[CommandOutcome] = Codec(CommandOutcome)


async def start_worker(bus_config: BusConfig, worker_id: str, role: WorkerRole) -> WorkerService:
    config = WorkerConfig(worker_id=worker_id, role=role, bus=bus_config, kv_blocks=1024, block_size=16,
                          max_num_seqs=DECODE_SLOTS, membership=MEMBERSHIP, load_interval_s=0.05,
                          kv_event_interval_s=0.01, drain_timeout_s=5.0)
    return await start_sim_worker(config, await connect(bus_config.nats_url, f"worker-{worker_id}"))


def planner(dry_run: bool, sustain_s: float) -> PlannerLoopConfig:
    return PlannerLoopConfig(enabled=True, dry_run=dry_run, interval_s=0.2, window_s=5.0, ttft_p90_ms=2000,
                             itl_p90_ms=1000, sustain_s=sustain_s, global_cooldown_s=30.0, worker_cooldown_s=30.0)


Cluster = tuple[OrchestratorService, dict[str, WorkerService], list[PlannerDecision]]


@contextlib.asynccontextmanager
async def long_generations(bus: Bus, bus_config: BusConfig, worker_id: str, count: int) -> AsyncIterator[None]:
    """`count` long generations running on `worker_id` (closed, i.e. cancelled, on exit)."""
    streams: list[ResponseStream] = []
    try:
        for index in range(count):
            request = GenerateRequest(request_id=f"long-{index}", model="tiny", token_ids=list(range(3, 40)),
                                      sampling=SamplingParams(max_tokens=2000, ignore_eos=True))
            stream = await open_stream(bus, bus_config.subjects.generate(worker_id), request)
            streams.append(stream)
            await stream.frames().__anext__()  # admitted and generating
        yield
    finally:
        for stream in streams:
            await stream.close()


@contextlib.asynccontextmanager
async def cluster(bus: Bus, bus_config: BusConfig, dry_run: bool, sustain_s: float = 0.5,
                  load: bool = True, records: Sequence[RequestRecord] = (),
                  launcher: str = "local", scalable: tuple[str, ...] = ()) -> AsyncIterator[Cluster]:
    """p1, p2 (prefill) and d1 (decode) with d1's batch full, then the orchestrator and its
    planner (so that its first tick sees the load: the idle prefill workers' cold trend and
    the decode worker's hot one start together). `records` are published as soon as the
    orchestrator listens, before any trend can be sustained, and again every half second
    while the cluster runs: a steady stream of such requests, never aged out of the
    planner's window however late its first decision comes."""
    events: list[PlannerDecision] = []

    async def heard(msg) -> None:
        events.append(decisions.decode(msg.data))

    async with contextlib.AsyncExitStack() as stack:
        subscription = await bus.client.subscribe(bus_config.subjects.planner_decisions, cb=heard)
        stack.push_async_callback(subscription.unsubscribe)
        workers: dict[str, WorkerService] = {}
        for worker_id, role in (("p1", WorkerRole.PREFILL), ("p2", WorkerRole.PREFILL), ("d1", WorkerRole.DECODE)):
            workers[worker_id] = worker = await start_worker(bus_config, worker_id, role)
            stack.push_async_callback(stop_worker, worker)
        if load:
            await stack.enter_async_context(long_generations(bus, bus_config, "d1", DECODE_SLOTS))
        orchestrator_bus = await connect(bus_config.nats_url, "orchestrator")
        stack.push_async_callback(orchestrator_bus.close)
        # a launcher (none is started here) lets the planner add and stop workers, not only switch
        config = OrchestratorConfig(bus=bus_config, membership=MEMBERSHIP, command_timeout_s=2.0,
                                    planner=planner(dry_run, sustain_s),
                                    launcher=WorkerLauncherConfig(kind=launcher, model_dir="unused-model-dir"),
                                    scale_to_zero=ScaleToZeroConfig(models=scalable))
        orchestrator = OrchestratorService(config, orchestrator_bus)
        await orchestrator.start()
        stack.push_async_callback(orchestrator.stop)
        if records:
            streaming = asyncio.create_task(stream(bus, bus_config, records))
            stack.push_async_callback(cancel, streaming)
        await wait_for(lambda: set(orchestrator.control.worker_ids()) >= set(workers), 5, "all workers registered")
        yield orchestrator, workers, events


async def stream(bus: Bus, bus_config: BusConfig, records: Sequence[RequestRecord]) -> None:
    while True:
        for record in records:
            await bus.client.publish(bus_config.subjects.request_events, encode(record))
        await bus.client.flush()
        await asyncio.sleep(0.5)


async def cancel(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def stop_worker(worker: WorkerService) -> None:
    if not worker.stopped.is_set():
        await worker.stop()
    await worker.bus.close()


def switch_in(events: list[PlannerDecision]) -> Callable[[], SwitchRole | None]:
    def found() -> SwitchRole | None:
        return next((a for e in events for a in e.actions if isinstance(a, SwitchRole)), None)
    return found


async def test_decode_bottleneck_switches_a_prefill_worker_to_decode(bus: Bus, bus_config: BusConfig) -> None:
    async with cluster(bus, bus_config, dry_run=False) as (orchestrator, workers, events):
        switched = switch_in(events)
        await wait_for(lambda: switched() is not None, 20, lambda: f"a role switch; heard {[e for e in events if e.actions]} {events[-1:]}")
        action = switched()
        assert action is not None and action.from_role is WorkerRole.PREFILL and action.to_role is WorkerRole.DECODE
        assert action.worker_id in ("p1", "p2")
        assert "decode pressure" in action.reason and "decode batch occupancy" in action.reason, action.reason
        event = next(e for e in events if action in e.actions)
        assert not event.dry_run and event.pressures["decode"] > 1.0
        await wait_for(lambda: (r := orchestrator.control.registration(action.worker_id)) is not None
                       and r.role is WorkerRole.DECODE, 10, "the switched worker registered as decode")
        assert workers[action.worker_id].role is WorkerRole.DECODE
        planner = orchestrator.planner
        assert planner is not None and planner.counts["switch_role"] == 1
        await wait_for(lambda: len(planner.outcomes) == 1, 5, "the switch's outcome")
        assert planner.outcomes[0].ok, planner.outcomes[0]


async def test_a_scalable_models_workers_are_not_the_planners(bus: Bus, bus_config: BusConfig) -> None:
    """The same decode bottleneck, but the workers serve a scalable model (its scaler starts
    and stops them): the planner counts none of them and acts on none."""
    async with cluster(bus, bus_config, dry_run=False, scalable=("tiny=unused-model-dir@2p1d",)) as (
            orchestrator, workers, events):
        await wait_for(lambda: len(events) >= 10, 10, "ten ticks")
        assert not any(e.actions for e in events), [e for e in events if e.actions]
        assert all("no active prefill or decode worker: no decision" in e.notes for e in events), events[-1:]
        for worker_id in ("p1", "p2"):
            registration = orchestrator.control.registration(worker_id)
            assert registration is not None and registration.role is WorkerRole.PREFILL


async def test_dry_run_publishes_the_decision_and_changes_nothing(bus: Bus, bus_config: BusConfig) -> None:
    async with cluster(bus, bus_config, dry_run=True) as (orchestrator, workers, events):
        switched = switch_in(events)
        await wait_for(lambda: switched() is not None, 20, lambda: f"a role switch; heard {[e for e in events if e.actions]} {events[-1:]}")
        action = switched()
        assert action is not None and action.to_role is WorkerRole.DECODE
        assert all(e.dry_run for e in events)
        ticks = len(events)
        await wait_for(lambda: len(events) >= ticks + 3, 5, "three more ticks")  # time to act, were it acting
        for worker_id in ("p1", "p2"):
            registration = orchestrator.control.registration(worker_id)
            assert registration is not None and registration.role is WorkerRole.PREFILL
            assert registration.generation == 0 and workers[worker_id].role is WorkerRole.PREFILL


async def test_an_operator_touched_worker_is_left_alone(bus: Bus, bus_config: BusConfig) -> None:
    async with cluster(bus, bus_config, dry_run=False, sustain_s=2.0) as (orchestrator, workers, events):
        for command in (CordonWorker(worker_id="p1"), UncordonWorker(worker_id="p1")):
            reply = await bus.client.request(bus_config.subjects.orchestrator_commands, encode(command), timeout=10)
            assert outcomes.decode(reply.data).ok
        switched = switch_in(events)
        await wait_for(lambda: switched() is not None, 20, lambda: f"a role switch; heard {events[-1:]}")
        action = switched()
        assert action is not None and action.worker_id == "p2"  # else p1 would go first (same load, by id)
        assert any("leaving p1 alone: operator command 'UncordonWorker'" in note for e in events for note in e.notes)


async def test_slow_tokens_in_the_router_records_make_decode_hot(bus: Bus, bus_config: BusConfig) -> None:
    """No load on the workers: the router's records alone (ITL over the SLO) make decode hot.
    Their TTFT (half the SLO) keeps the idle prefill workers from counting as cold, and too
    busy to give one up (0.5 each, 1.0 with one fewer): the planner asks for a new decode
    worker (dry run: published, not started)."""
    slow = RequestRecord(request_id="r", model="tiny", worker_id="d1", outcome="ok", finish_reason="length",
                         prompt_tokens=40, cached_tokens=0, completion_tokens=101, ttft_s=1.0, duration_s=301.0)
    records = [slow] * 5  # 3 s a token
    async with cluster(bus, bus_config, dry_run=True, sustain_s=2.0, load=False, records=records) as (
            orchestrator, workers, events):
        await wait_for(lambda: any(e.actions for e in events), 20, lambda: f"an action; heard {events[-1:]}")
        action = next(a for e in events for a in e.actions)
        assert isinstance(action, ScaleUp) and action.role is WorkerRole.DECODE, action
        assert "ITL p90 3000.0 ms vs SLO 1000.0 ms" in action.reason, action.reason
        assert orchestrator.control.launcher.list() == [] and set(orchestrator.control.worker_ids()) == set(workers)


async def test_an_idle_prefill_worker_is_drained_and_leaves(bus: Bus, bus_config: BusConfig) -> None:
    async with cluster(bus, bus_config, dry_run=False, load=False) as (orchestrator, workers, events):
        await wait_for(lambda: any(e.actions for e in events), 20, lambda: f"an action; heard {events[-1:]}")
        action = next(a for e in events for a in e.actions)
        assert isinstance(action, ScaleDown) and action.worker_id == "p1", action  # least loaded, by id
        assert "prefill pressure 0.00" in action.reason and "with one fewer" in action.reason, action.reason
        planner = orchestrator.planner
        assert planner is not None
        await wait_for(lambda: len(planner.outcomes) == 1, 15, "the scale-down's outcome")
        assert planner.outcomes[0].ok and planner.outcomes[0].reason.startswith("drained and left"), planner.outcomes
        assert orchestrator.control.registration("p1") is None
        # the worker leaves the members first, then stops its engine and says it stopped
        await wait_for(lambda: workers["p1"].stopped.is_set(), 10, "p1 stopped")


async def test_without_a_launcher_an_idle_worker_is_kept(bus: Bus, bus_config: BusConfig) -> None:
    """No launcher could bring a stopped worker back: the planner keeps the idle prefill
    worker (to switch it later) and says why, instead of draining it away for good."""
    async with cluster(bus, bus_config, dry_run=False, load=False, launcher="none") as (orchestrator, workers, events):
        kept = "prefill is cold: keeping its workers (no launcher would bring one back)"
        await wait_for(lambda: any(kept in note for e in events for note in e.notes), 20,
                       lambda: f"the note {kept!r}; heard {events[-1:]}")
        assert not any(e.actions for e in events)
        assert set(orchestrator.control.worker_ids()) == set(workers)


async def test_no_action_while_a_rolling_upgrade_runs_and_the_planner_resumes_after(
        bus: Bus, bus_config: BusConfig, monkeypatch) -> None:
    """The decode bottleneck of the first test, during a rolling upgrade (marked as running on the
    orchestrator's control plane): every decision says why it does nothing; once the upgrade is
    over, the planner switches a prefill worker as before."""
    import services.orchestrator.planner_loop as planner_loop

    upgrading = {"now": True}
    monkeypatch.setattr(planner_loop, "upgrade_running", lambda control: upgrading["now"])
    async with cluster(bus, bus_config, dry_run=False) as (orchestrator, workers, events):
        note = "a rolling upgrade is running: no planner action until it ends"
        # decode's occupancy is over its target from the first tick: sustained (0.5 s) many times over
        await wait_for(lambda: sum(note in e.notes and e.pressures.get("decode", 0) > 1.0 for e in events) >= 10,
                       10, lambda: f"ten paused ticks with decode hot; heard {events[-1:]}")
        assert not any(e.actions for e in events)
        planner = orchestrator.planner
        assert planner is not None and planner.outcomes == []
        upgrading["now"] = False
        switched = switch_in(events)
        await wait_for(lambda: switched() is not None, 20, lambda: f"a role switch; heard {events[-1:]}")
        action = switched()
        assert action is not None and action.to_role is WorkerRole.DECODE
        assert note not in next(e for e in events if action in e.actions).notes
