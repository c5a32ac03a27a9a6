"""`decide`: one planner tick (pure, synchronous; `now` is passed in).

Order of business, at most one action per tick:

1. update each role's hot and cold trends (hysteresis, `signals.track`);
2. a pause (a rolling upgrade is running) stops everything and restarts every sustain run;
   an operator hold stops everything; operator-touched workers are left alone for
   `operator_hold_s` (noted every tick, so the event says why the planner did not touch them);
3. a global cooldown after any action, and a per-worker cooldown, let the last action show
   its effect before the next;
4. a worker count over the budget is trimmed first;
5. a role hot for `sustain_s` gets relief: a switch of the other role's least-loaded worker
   when that role is not hot and stays below `hot_exit` with one fewer worker (cheap: no
   new process), else a scale-up within the budget; not a prefill role hot on its latency
   alone whose capacity covers its demand and whose queue drains within `sustain_s`;
6. a role cold for `sustain_s` gives up its least-loaded worker when it stays below
   `hot_exit` without it and keeps its minimum, unless the other role is hot: then the
   worker is kept for a switch (stopping it would leave the hot role a slower scale-up).

Without a launcher (`PlannerConfig.can_add_workers` false) the planner neither adds nor
stops workers: it only switches roles, as a stopped worker could never be brought back.

After an action the acted-on trends restart their sustain clock: the next action on the same
signal needs it held again, with the new capacity in place.
"""

from __future__ import annotations

from services.orchestrator.planning.model import (
    ClusterSnapshot,
    Decision,
    PlannerConfig,
    PlannerState,
    RoleLoad,
    Slos,
    Trend,
)
from services.orchestrator.planning.signals import Pressure, after_one_fewer, role_pressure, sustained, track
from shared.schemas.membership import WorkerRole
from shared.schemas.planner import PlannerAction, ScaleDown, ScaleUp, SwitchRole

ROLES = (WorkerRole.PREFILL, WorkerRole.DECODE)


def _other(role: WorkerRole) -> WorkerRole:
    return WorkerRole.DECODE if role is WorkerRole.PREFILL else WorkerRole.PREFILL


class _Tick:
    """The working state of one `decide` call."""

    def __init__(self, snapshot: ClusterSnapshot, slos: Slos, state: PlannerState, now: float,
                 config: PlannerConfig) -> None:
        self.snapshot, self.state, self.now, self.config = snapshot, state, now, config
        th = config.thresholds
        self.loads: dict[WorkerRole, RoleLoad] = {WorkerRole.PREFILL: snapshot.prefill,
                                                   WorkerRole.DECODE: snapshot.decode}
        self.pressures: dict[WorkerRole, Pressure] = {
            role: role_pressure(role, self.loads[role], slos, th) for role in ROLES}
        self.trends: dict[str, Trend] = dict(state.trends)
        for role in ROLES:
            value = self.pressures[role].value
            for hot, enter, leave in ((True, th.hot_enter, th.hot_exit), (False, th.cold_enter, th.cold_exit)):
                key = _key(role, hot)
                self.trends[key] = track(self.trends.get(key), value, enter=enter, exit=leave, hot=hot, now=now)
        self.touched = {touch.worker_id: touch for touch in snapshot.operator_touches
                        if now - touch.at < config.operator_hold_s}
        self.notes: list[str] = [
            f"leaving {worker_id} alone: operator command {touch.command or 'change'!r} "
            f"{now - touch.at:.0f} s ago (hold {config.operator_hold_s:.0f} s)"
            for worker_id, touch in sorted(self.touched.items())]

    def count(self, role: WorkerRole) -> int:
        return self.loads[role].count

    def total(self) -> int:
        return sum(self.count(role) for role in ROLES)

    def hot(self, role: WorkerRole) -> Trend:
        return self.trends[_key(role, True)]

    def cold(self, role: WorkerRole) -> Trend:
        return self.trends[_key(role, False)]

    def movable(self, role: WorkerRole) -> list[str]:
        """Workers of `role` the planner may act on now, least loaded first."""
        last = self.state.worker_last_action
        workers = [worker for worker in self.loads[role].workers if worker.worker_id not in self.touched
                   and self.now - last.get(worker.worker_id, float("-inf")) >= self.config.worker_cooldown_s]
        return [worker.worker_id for worker in sorted(workers, key=lambda worker: (worker.load, worker.worker_id))]

    def held_s(self, trend: Trend) -> float:
        return self.now - trend.held_since if trend.held_since is not None else 0.0

    def decision(self, action: PlannerAction | None, roles: tuple[WorkerRole, ...] = (),
                 worker_id: str | None = None) -> Decision:
        """The tick's outcome; an action stamps the cooldowns and restarts the sustain runs
        of the trends of `roles` (the roles it changed)."""
        pressures = {role.value: round(self.pressures[role].value, 4) for role in ROLES}
        if action is None:
            state = PlannerState(last_action_at=self.state.last_action_at,
                                 worker_last_action=self.state.worker_last_action, trends=self.trends)
            return Decision(actions=[], notes=self.notes, state=state, pressures=pressures)
        acted = {role.value for role in roles}
        trends = {key: Trend(active=trend.active, held_since=self.now)
                  if trend.held_since is not None and key.split(".")[0] in acted else trend
                  for key, trend in self.trends.items()}
        last = dict(self.state.worker_last_action)
        if worker_id is not None:
            last[worker_id] = self.now
        state = PlannerState(last_action_at=self.now, worker_last_action=last, trends=trends)
        return Decision(actions=[action], notes=self.notes, state=state, pressures=pressures)

    def paused(self) -> Decision:
        """No action while another operation changes the cluster; every sustain run restarts, so
        an action after it needs its signal held for `sustain_s` on the cluster it left."""
        trends = {key: Trend(active=trend.active, held_since=self.now) if trend.held_since is not None else trend
                  for key, trend in self.trends.items()}
        state = PlannerState(last_action_at=self.state.last_action_at,
                             worker_last_action=self.state.worker_last_action, trends=trends)
        pressures = {role.value: round(self.pressures[role].value, 4) for role in ROLES}
        return Decision(actions=[], notes=self.notes, state=state, pressures=pressures)


def _key(role: WorkerRole, hot: bool) -> str:
    return f"{role.value}.{'hot' if hot else 'cold'}"


def decide(snapshot: ClusterSnapshot, slos: Slos, state: PlannerState, now: float,
           config: PlannerConfig = PlannerConfig()) -> Decision:
    tick = _Tick(snapshot, slos, state, now, config)
    if snapshot.paused:
        tick.notes.append(f"{snapshot.paused}: no planner action until it ends")
        return tick.paused()
    if snapshot.operator_hold_until is not None and now < snapshot.operator_hold_until:
        tick.notes.append(f"operator hold for {snapshot.operator_hold_until - now:.0f} s more: no actions")
        return tick.decision(None)
    if state.last_action_at is not None and now - state.last_action_at < config.global_cooldown_s:
        tick.notes.append(f"cooldown: last action {now - state.last_action_at:.0f} s ago "
                          f"(global cooldown {config.global_cooldown_s:.0f} s)")
        return tick.decision(None)
    return _over_budget(tick) or _relieve_hot(tick) or _release_cold(tick) or tick.decision(None)


def _over_budget(tick: _Tick) -> Decision | None:
    budget = tick.config.budget
    over = [role for role in ROLES if tick.count(role) > budget.role_max(role)]
    if not over and tick.total() > budget.max_total:
        over = sorted(ROLES, key=lambda role: tick.pressures[role].value)
    for role in over:
        if tick.count(role) <= budget.role_min(role):
            continue
        for worker_id in tick.movable(role)[:1]:
            reason = (f"over budget: {tick.count(role)} {role.value} of max {budget.role_max(role)}, "
                      f"{tick.total()} workers of max {budget.max_total}")
            return tick.decision(ScaleDown(worker_id=worker_id, role=role, reason=reason), (role,), worker_id)
    return None


def _relieve_hot(tick: _Tick) -> Decision | None:
    th, budget = tick.config.thresholds, tick.config.budget
    hot = sorted((role for role in ROLES if sustained(tick.hot(role), tick.now, th.sustain_s)),
                 key=lambda role: -tick.pressures[role].value)
    for role in hot:
        pressure = tick.pressures[role]
        why = f"{role.value} pressure {pressure.value:.2f} for {tick.held_s(tick.hot(role)):.0f} s: {pressure.why}"
        draining = _draining(tick, role)
        if draining is not None:
            tick.notes.append(f"{why}; {draining}")
            continue
        donor = _other(role)
        donor_after = after_one_fewer(tick.pressures[donor], tick.count(donor))
        room = tick.count(role) < budget.role_max(role)
        if room and not tick.hot(donor).active and tick.count(donor) > budget.role_min(donor) \
                and donor_after < th.hot_exit:
            candidates = tick.movable(donor)
            if candidates:
                reason = (f"{why}; {donor.value} has room ({tick.pressures[donor].value:.2f} now, "
                          f"{donor_after:.2f} with one fewer)")
                action = SwitchRole(worker_id=candidates[0], from_role=donor, to_role=role, reason=reason)
                return tick.decision(action, (role, donor), candidates[0])
            tick.notes.append(f"{why}; no {donor.value} worker free to switch (operator hold or cooldown)")
        if room and tick.total() < budget.max_total and tick.config.can_add_workers:
            return tick.decision(ScaleUp(role=role, reason=why), (role,))
        if room and tick.total() < budget.max_total:
            tick.notes.append(f"{why}; no launcher to add a {role.value} worker, and no worker to switch")
            continue
        tick.notes.append(f"{why}; budget reached ({tick.count(role)} {role.value} of max "
                          f"{budget.role_max(role)}, {tick.total()} workers of max {budget.max_total})")
    return None


def _draining(tick: _Tick, role: WorkerRole) -> str | None:
    """Why a hot prefill role needs no worker more, or None: its capacity covers its demand
    (utilisation under `hot_exit`) and its queued prompt tokens drain within `sustain_s` at the
    spare capacity, so its latency is a backlog going away (e.g. from before the last action),
    which another worker would not shorten by much and would leave one too many after."""
    pressure, load = tick.pressures[role], tick.loads[role]
    if role is not WorkerRole.PREFILL or pressure.utilisation is None \
            or pressure.utilisation >= tick.config.thresholds.hot_exit:
        return None
    backlog = sum(worker.load for worker in load.workers)
    spare = load.prefill_capacity_tok_s - load.prefill_demand_tok_s
    drain_s = backlog / spare if spare > 0 else float("inf")
    if drain_s > tick.config.thresholds.sustain_s:
        return None
    return (f"no relief: capacity covers demand ({pressure.utilisation:.2f}) and its {backlog:.0f} queued "
            f"prompt tokens drain in {drain_s:.1f} s")


def _release_cold(tick: _Tick) -> Decision | None:
    th, budget = tick.config.thresholds, tick.config.budget
    cold = sorted((role for role in ROLES if sustained(tick.cold(role), tick.now, th.sustain_s)),
                  key=lambda role: tick.pressures[role].value)
    for role in cold:
        after = after_one_fewer(tick.pressures[role], tick.count(role))
        if tick.hot(role).active or tick.count(role) <= budget.role_min(role) or after >= th.hot_exit:
            continue
        if tick.hot(_other(role)).active:  # the other role may need this worker: a switch, not a stop
            tick.notes.append(f"{role.value} is cold but {_other(role).value} is hot: keeping its workers "
                              f"to switch rather than stop")
            continue
        if not tick.config.can_add_workers:  # a stopped worker could not come back: keep it to switch
            tick.notes.append(f"{role.value} is cold: keeping its workers (no launcher would bring one back)")
            continue
        for worker_id in tick.movable(role)[:1]:
            reason = (f"{role.value} pressure {tick.pressures[role].value:.2f} for "
                      f"{tick.held_s(tick.cold(role)):.0f} s ({tick.pressures[role].why}); "
                      f"{after:.2f} with one fewer")
            return tick.decision(ScaleDown(worker_id=worker_id, role=role, reason=reason), (role,), worker_id)
    return None
