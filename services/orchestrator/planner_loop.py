"""The SLO planner in the orchestrator (adapter): cluster in, decisions out, actions carried out.

Every `planner.interval_s` it builds the planner's `ClusterSnapshot` (`planner_inputs`) from
the members (the orchestrator's mirror), the workers' load snapshots (`LoadStream`) and the
router's request records (`requests.events`) over the last `window_s` (what a
`cluster_watcher.ClusterWatcher` takes in), calls the pure `decide()`, and

- publishes the tick as a `PlannerDecision` on `planner.decisions` (every tick, with or
  without actions: the notes say what it chose not to do), logs each action with its reason,
  and counts decisions by action kind in `counts` (the orchestrator exposes no metrics
  endpoint: the counts are for tests and the log);
- while a rolling upgrade runs (`rolling_upgrade.upgrade_running`), the snapshot says so
  (`ClusterSnapshot.paused`): the decision takes no action and its notes say why; every
  sustain run restarts, so the planner resumes once the upgrade ended and a signal held
  `sustain_s` on the upgraded cluster;
- while a role has no active worker, or a planned worker has sent no load snapshot yet (the planner just started, or the
  worker just joined), it publishes a note and decides nothing: its idle-looking figures
  would start a cold trend;
- unless `dry_run`, carries each action out (in its own task; until it ends, ticks publish a
  note and decide nothing) through the control plane, as the matching
  orchestrator command: SwitchRole -> SetWorkerRole, ScaleUp -> AddWorker (the launcher),
  ScaleDown -> RemoveWorker (drain, then stop). A refused or failed command is logged; the
  planner's cooldowns hold it back from retrying at once.

Workers of a scalable model (`--scalable-model`) and that model's requests are not the
planner's: its scaler starts and stops them with its requests, so the planner neither counts
them nor acts on them.

Operator commands (`tandem ctl`, on the command subject) are watched here too: each one that
names a worker marks it operator-touched, and the planner leaves it alone for
`operator_hold_s`. The planner's own commands go straight to the control plane, not over
the subject, so they do not count as an operator's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping

from nats.aio.msg import Msg

from services.orchestrator.cluster_watcher import ClusterWatcher, MessageHandler
from services.orchestrator.config import OrchestratorConfig, PlannerLoopConfig
from services.orchestrator.control_plane import ControlPlane
from services.orchestrator.planner_inputs import (
    RecordSample,
    build_snapshot,
    measured_prefill_rates,
    planned_workers,
    sample,
)
from services.orchestrator.planning import (
    Budget,
    OperatorTouch,
    PlannerConfig,
    PlannerState,
    Slos,
    Thresholds,
    decide,
)
from services.orchestrator.rolling_upgrade import upgrade_running
from shared.bus import Bus
from shared.cluster.member_events import MemberChange, MemberEvent
from shared.codec import Codec, MalformedCounter, encode
from shared.lifecycle import reraise_if_cancelling
from shared.schemas import LoadSnapshot, RequestRecord, WorkerRegistration, WorkerRole
from shared.schemas.orchestrator import (
    AddWorker,
    CommandOutcome,
    OrchestratorCommand,
    RemoveWorker,
    SetWorkerRole,
)
from shared.schemas.planner import PlannerAction, PlannerDecision, ScaleDown, ScaleUp, SwitchRole

log = logging.getLogger(__name__)


def planner_config(config: PlannerLoopConfig, *, can_add_workers: bool = True) -> PlannerConfig:
    return PlannerConfig(budget=Budget(max_prefill=config.max_workers - 1, max_decode=config.max_workers - 1,
                                       max_total=config.max_workers),
                         thresholds=Thresholds(sustain_s=config.sustain_s),
                         global_cooldown_s=config.global_cooldown_s, worker_cooldown_s=config.worker_cooldown_s,
                         operator_hold_s=config.operator_hold_s, can_add_workers=can_add_workers)


def command_for(action: PlannerAction, drain_deadline_s: float) -> OrchestratorCommand:
    match action:
        case SwitchRole(worker_id=worker_id, to_role=role):
            return SetWorkerRole(worker_id=worker_id, role=role)
        case ScaleUp(role=role):
            return AddWorker(role=role)
        case ScaleDown(worker_id=worker_id):
            return RemoveWorker(worker_id=worker_id, deadline_s=drain_deadline_s)
    raise AssertionError(f"unknown action {action!r}")


def action_kind(action: PlannerAction) -> str:
    return {SwitchRole: "switch_role", ScaleUp: "scale_up", ScaleDown: "scale_down"}[type(action)]


class PlannerLoop(ClusterWatcher):
    name = "planner"

    def __init__(self, config: OrchestratorConfig, bus: Bus, members: Callable[[], Mapping[str, WorkerRegistration]],
                 control: ControlPlane, malformed: MalformedCounter, *,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        super().__init__(config, bus, members, control, malformed, interval_s=config.planner.interval_s,
                         clock=clock, wall=wall)
        self._config = config.planner
        # A scalable model's workers come and go with its requests (`model_scaler`, `model_wake`):
        # the planner leaves them, and that model's requests, alone.
        self._scaled_models = frozenset(config.scale_to_zero.scalable())
        self._wall = wall
        self._slos = Slos(ttft_p90_ms=self._config.ttft_p90_ms, itl_p90_ms=self._config.itl_p90_ms)
        # the orchestrator without a launcher cannot start a worker: the planner only switches roles
        self._planner = planner_config(self._config, can_add_workers=config.launcher.kind != "none")
        self.state = PlannerState()
        self.counts: Counter[str] = Counter()  # decisions by action kind ("none": no action)
        self.last: PlannerDecision | None = None
        self.outcomes: list[CommandOutcome] = []  # of the actions carried out, in order
        self._history: dict[str, deque[LoadSnapshot]] = {}
        self._measured: dict[str, float] = {}  # each worker's prefill rate while busy, as last measured
        self._samples: deque[RecordSample] = deque()
        self._touches: dict[str, OperatorTouch] = {}
        # The control plane counts malformed commands already; this watcher only looks.
        self._commands: Codec[OrchestratorCommand] = Codec(OrchestratorCommand, MalformedCounter())
        self._acting: asyncio.Task[None] | None = None  # the action being carried out
        self._acting_on = ""

    async def start(self) -> None:
        await super().start()
        log.info("planner on (%s): every %g s, SLOs TTFT p90 %g ms, ITL p90 %g ms",
                 "dry run" if self._config.dry_run else "acting", self._config.interval_s,
                 self._config.ttft_p90_ms, self._config.itl_p90_ms)

    def _watched(self) -> list[tuple[str, MessageHandler]]:
        return [(self._subjects.orchestrator_commands, self._on_command)]

    def _own_tasks(self) -> tuple[asyncio.Task[None] | None, ...]:
        return (self._acting,)

    # ---- inputs ----------------------------------------------------------------------

    def _planned_members(self) -> dict[str, WorkerRegistration]:
        """The workers the planner plans: every member but those of a scalable model."""
        return {worker_id: registration for worker_id, registration in self._members().items()
                if registration.model not in self._scaled_models}

    def on_member(self, event: MemberEvent) -> None:
        super().on_member(event)
        if event.change is MemberChange.LEFT:
            self._history.pop(event.worker_id, None)
            self._measured.pop(event.worker_id, None)

    def _on_snapshot(self, snapshot: LoadSnapshot) -> None:
        registration = self._members().get(snapshot.worker_id)
        if registration is None or registration.model in self._scaled_models:
            return
        history = self._history.setdefault(snapshot.worker_id, deque())
        history.append(snapshot)
        while history and history[0].ts < snapshot.ts - self._config.window_s:
            history.popleft()

    def _on_record(self, record: RequestRecord) -> None:
        if record.model in self._scaled_models:
            return
        figures = sample(record, self._clock())
        if figures is not None:
            self._samples.append(figures)

    async def _on_command(self, msg: Msg) -> None:
        command = self._commands.decode_or_none(msg.data, msg.subject)
        worker_id = getattr(command, "worker_id", "")
        if command is not None and worker_id:
            self._touches[worker_id] = OperatorTouch(worker_id=worker_id, at=self._clock(),
                                                     command=type(command).__name__)

    # ---- the tick --------------------------------------------------------------------

    async def _tick(self) -> None:
        await self.tick()

    def _trim(self, now: float) -> None:
        while self._samples and self._samples[0].at < now - self._config.window_s:
            self._samples.popleft()
        for worker_id, touch in list(self._touches.items()):
            if now - touch.at >= self._planner.operator_hold_s:
                del self._touches[worker_id]

    async def tick(self) -> PlannerDecision:
        now = self._clock()
        self._trim(now)
        members = self._planned_members()
        if self._acting is not None and not self._acting.done():
            return await self._undecided(f"still carrying out {self._acting_on}: no decision")
        paused = "a rolling upgrade is running" if upgrade_running(self._control) else ""
        empty = [role.value for role in (WorkerRole.PREFILL, WorkerRole.DECODE) if not planned_workers(members, role)]
        if empty:  # an empty role has no figures: its trends would start on nothing
            return await self._undecided(f"no active {' or '.join(empty)} worker: no decision", paused)
        unseen = [w for w in planned_workers(members) if not self._history.get(w)]
        if unseen:  # deciding without a worker's load would read it as idle
            return await self._undecided(f"waiting for the first load snapshot of {', '.join(unseen)}: no decision",
                                         paused)
        self._measured.update(measured_prefill_rates(members, self._history))
        snapshot = build_snapshot(members, self._history, list(self._samples), list(self._touches.values()),
                                  prefill_capacity_tok_s=self._config.prefill_capacity_tok_s,
                                  measured_prefill_tok_s=self._measured, paused=paused,
                                  since=self.state.last_action_at)
        decision = decide(snapshot, self._slos, self.state, now, self._planner)
        self.state = decision.state
        event = PlannerDecision(ts=self._wall(), actions=decision.actions, notes=decision.notes,
                                dry_run=self._config.dry_run, pressures=decision.pressures)
        self.last = event
        await self._bus.client.publish(self._subjects.planner_decisions, encode(event))
        if not decision.actions:
            self.counts["none"] += 1
            log.debug("planner: no action (pressures %s): %s", decision.pressures, "; ".join(decision.notes))
        for action in decision.actions:
            self.counts[action_kind(action)] += 1
            log.info("planner%s: %s (pressures %s)", " (dry run)" if self._config.dry_run else "", action,
                     decision.pressures)
            if not self._config.dry_run:
                self._acting_on = f"{action_kind(action)} " + (
                    action.role.value if isinstance(action, ScaleUp) else action.worker_id)
                self._acting = asyncio.create_task(self._carry_out(action), name="planner-action")
        return event

    async def _undecided(self, note: str, paused: str = "") -> PlannerDecision:
        notes = [f"{paused}: no planner action until it ends", note] if paused else [note]
        event = PlannerDecision(ts=self._wall(), dry_run=self._config.dry_run, notes=notes)
        self.last = event
        self.counts["undecided"] += 1
        await self._bus.client.publish(self._subjects.planner_decisions, encode(event))
        return event

    async def _carry_out(self, action: PlannerAction) -> None:
        """The action as an orchestrator command, in its own task (a drain takes a while: the
        ticks go on publishing meanwhile, deciding nothing until it ends)."""
        try:
            outcome = await self._control.execute(command_for(action, self._config.drain_deadline_s))
        except Exception as error:
            reraise_if_cancelling(error)
            log.exception("planner action %r failed", action)
            outcome = CommandOutcome(outcome="failed", reason=f"internal error: {error}")
        self.outcomes.append(outcome)
        log.info("planner: %s %s: %s", action_kind(action), outcome.outcome, outcome.reason)
