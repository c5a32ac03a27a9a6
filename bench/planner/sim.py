"""A disaggregated cluster of sim workers whose roles can change (pure discrete-event
simulation, faster than real time), with the SLO planner ticking inside it or not.

Each worker is an `EngineModel` (the sim engine's batching and timing profile). A request
arrives, goes to the prefill worker with the fewest queued prompt tokens, samples its first
token there, then moves (after `handoff_ms`) to the decode worker with the fewest requests
assigned, whose blocks arrive by transfer, and decodes the rest. Workers are chosen by
their role at that moment, so a role switch steers new work while what a worker holds runs
to its end, as in the real stack.

With a planner, every `interval_s` the simulation builds the planner's `ClusterSnapshot`
the way the orchestrator's adapter does (`planner_inputs.build_snapshot`: request records
of the last `window_s` as they complete, each worker's load), calls `decide()` and carries
the action out: a switch at once, a scale-up after `start_s`, a scale-down as a drain
(routed no more work, gone once idle). Worker-seconds count from a worker's launch to its
exit.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from bench.plan.engine_model import EngineModel, SeqModel
from services.orchestrator.planner_inputs import RecordSample, build_snapshot, measured_prefill_rates
from services.orchestrator.planning import PlannerConfig, PlannerState, Slos, decide
from services.worker.sim.profile import TimingProfile
from shared.config import WorkerConfig
from shared.schemas import LoadSnapshot, WorkerCapacity, WorkerRegistration, WorkerRole, WorkerStatus
from shared.schemas.planner import ScaleDown, ScaleUp, SwitchRole


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    duration_s: float
    rate: float  # Poisson arrivals per second
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class Arrival:
    index: int
    at_s: float
    phase: str
    prompt_tokens: int
    output_tokens: int


def arrivals(phases: list[Phase], seed: int) -> list[Arrival]:
    rng = np.random.default_rng([seed, 7])
    out: list[Arrival] = []
    start = 0.0
    for phase in phases:
        at = start + rng.exponential(1 / phase.rate)
        while at < start + phase.duration_s:
            spread = rng.uniform(0.75, 1.25, size=2)
            out.append(Arrival(index=len(out), at_s=float(at), phase=phase.name,
                               prompt_tokens=max(1, int(phase.prompt_tokens * spread[0])),
                               output_tokens=max(2, int(phase.output_tokens * spread[1]))))
            at += rng.exponential(1 / phase.rate)
        start += phase.duration_s
    return out


@dataclass(eq=False)
class SimWorker:
    worker_id: str
    engine: EngineModel
    role: WorkerRole
    launched_at: float
    ready_at: float
    draining: bool = False
    exited_at: float | None = None
    assigned: int = 0  # requests whose decode part is (or will be) here
    uncached_total: int = 0  # prompt tokens it was given to compute, cumulative

    def serving(self, role: WorkerRole, now: float) -> bool:
        return self.role is role and not self.draining and self.exited_at is None and now >= self.ready_at


@dataclass(slots=True)
class Outcome:
    arrival: Arrival
    token_at: list[float] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        return self.token_at[0] - self.arrival.at_s

    @property
    def itl_s(self) -> float:
        """The mean gap between tokens (what the router's records let the planner see)."""
        if len(self.token_at) < 2:
            return 0.0
        return (self.token_at[-1] - self.token_at[0]) / (len(self.token_at) - 1)


@dataclass(frozen=True, slots=True)
class PlannerSetup:
    slos: Slos
    config: PlannerConfig
    interval_s: float = 2.0
    window_s: float = 10.0
    start_s: float = 5.0  # a new worker's start-up, before it serves
    prefill_capacity_tok_s: float = 0.0  # one prefill worker's throughput, as the operator configures it (0: unknown)


@dataclass(frozen=True, slots=True)
class SimOptions:
    profile: TimingProfile
    worker: WorkerConfig
    handoff_ms: float = 5.0


class PlannedCluster:
    def __init__(self, prefill: int, decode: int, options: SimOptions, planner: PlannerSetup | None) -> None:
        self.options, self.planner = options, planner
        self.workers: list[SimWorker] = []
        self.events: list[tuple[float, int, str, object]] = []
        self.sequence = 0
        self.outcomes: dict[int, Outcome] = {}
        self.phase_of: dict[int, str] = {}  # request -> "prefill" | "decode"
        self.decode_of: dict[int, SimWorker] = {}
        self.samples: list[RecordSample] = []
        self.measured: dict[str, float] = {}  # each prefill worker's busy rate, as last measured
        self.history: dict[str, list[LoadSnapshot]] = {}  # each worker's load snapshots of the window
        self.state = PlannerState()
        self.actions: list[dict] = []
        for _ in range(prefill):
            self._launch(WorkerRole.PREFILL, 0.0, ready_at=0.0)
        for _ in range(decode):
            self._launch(WorkerRole.DECODE, 0.0, ready_at=0.0)

    def _launch(self, role: WorkerRole, now: float, ready_at: float) -> SimWorker:
        worker_id = f"w{len(self.workers)}"
        engine = EngineModel(worker_id, self.options.profile, self.options.worker)
        worker = SimWorker(worker_id=worker_id, engine=engine, role=role, launched_at=now, ready_at=ready_at)
        self.workers.append(worker)
        return worker

    def push(self, at: float, kind: str, payload: object) -> None:
        self.sequence += 1
        heapq.heappush(self.events, (at, self.sequence, kind, payload))

    def run(self, requests: list[Arrival]) -> list[Outcome]:
        for arrival in requests:
            self.outcomes[arrival.index] = Outcome(arrival)
            self.push(arrival.at_s, "arrive", arrival)
        end = max((a.at_s for a in requests), default=0.0)
        if self.planner is not None:
            self.push(self.planner.interval_s, "tick", None)
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrive":
                assert isinstance(payload, Arrival)
                self._route(now, payload)
            elif kind == "handoff":
                assert isinstance(payload, SeqModel)
                self._handoff(now, payload)
            elif kind == "tick":
                self._tick(now)
                if now < end or any(w.engine.has_work for w in self.workers):
                    assert self.planner is not None
                    self.push(now + self.planner.interval_s, "tick", None)
            else:
                assert isinstance(payload, tuple)
                self._step_end(now, *payload)
        last = max((o.token_at[-1] for o in self.outcomes.values() if o.token_at), default=end)
        for worker in self.workers:
            if worker.exited_at is None:
                worker.exited_at = last
        return [self.outcomes[index] for index in sorted(self.outcomes)]

    def worker_seconds(self) -> float:
        return sum((w.exited_at or 0.0) - w.launched_at for w in self.workers)

    def _pick(self, role: WorkerRole, now: float, key) -> SimWorker:
        candidates = [w for w in self.workers if w.serving(role, now)]
        assert candidates, f"no {role.value} worker serving"
        return min(candidates, key=key)

    def _route(self, now: float, arrival: Arrival) -> None:
        worker = self._pick(WorkerRole.PREFILL, now, lambda w: (w.engine.pending_prefill_tokens(), w.worker_id))
        worker.uncached_total += arrival.prompt_tokens
        self.phase_of[arrival.index] = "prefill"
        self._enqueue(now, worker, SeqModel(request=arrival.index, num_tokens=arrival.prompt_tokens, outputs_left=1))

    def _handoff(self, now: float, seq: SeqModel) -> None:
        worker = self._pick(WorkerRole.DECODE, now, lambda w: (w.assigned, w.worker_id))
        worker.assigned += 1
        self.decode_of[seq.request] = worker
        self.phase_of[seq.request] = "decode"
        self._enqueue(now, worker, seq)

    def _enqueue(self, now: float, worker: SimWorker, seq: SeqModel) -> None:
        worker.engine.add(seq)
        if not worker.engine.stepping:
            self._start_step(now, worker)

    def _start_step(self, now: float, worker: SimWorker) -> None:
        plan = worker.engine.step()
        if plan.duration_s == 0 and not plan.sampled:
            worker.engine.stepping = False
            return
        worker.engine.stepping = True
        self.push(now + plan.duration_s, "step", (worker, plan.sampled))

    def _step_end(self, now: float, worker: SimWorker, sampled: list[tuple[SeqModel, bool]]) -> None:
        size = self.options.worker.block_size
        for seq, finished in sampled:
            outcome = self.outcomes[seq.request]
            outcome.token_at.append(now)
            if self.phase_of[seq.request] == "prefill":
                arrival = outcome.arrival
                handed = SeqModel(request=seq.request, num_tokens=arrival.prompt_tokens + 1,
                                  outputs_left=arrival.output_tokens - 1,
                                  reused_tokens=arrival.prompt_tokens // size * size)
                self.push(now + self.options.handoff_ms / 1000, "handoff", handed)
            elif finished:
                self.decode_of[seq.request].assigned -= 1
                self.samples.append(RecordSample(at=now, ttft_ms=outcome.ttft_s * 1000, itl_ms=outcome.itl_s * 1000,
                                                 arrived_at=outcome.arrival.at_s))
        if worker.engine.has_work:
            self._start_step(now, worker)
        else:
            worker.engine.stepping = False
            if worker.draining and worker.assigned == 0:
                worker.exited_at = now

    # ---- the planner --------------------------------------------------------------------

    def _tick(self, now: float) -> None:
        assert self.planner is not None
        setup = self.planner
        live = [w for w in self.workers if w.exited_at is None and not w.draining and now >= w.ready_at]
        members, loads = {}, {}
        for w in live:
            capacity = WorkerCapacity(kv_blocks=self.options.worker.kv_blocks,
                                      max_num_seqs=self.options.worker.max_num_seqs, max_model_len=0)
            members[w.worker_id] = WorkerRegistration(
                worker_id=w.worker_id, role=w.role, model="sim", engine="sim", block_size=self.options.worker.block_size,
                compat_hash="", capacity=capacity, status=WorkerStatus.ACTIVE, started_at=0.0, heartbeat_at=now)
            engine = w.engine
            history = self.history.setdefault(w.worker_id, [])
            history.append(LoadSnapshot(
                worker_id=w.worker_id, seq=0, ts=now, running=len(engine.running), waiting=len(engine.waiting),
                kv_total_blocks=self.options.worker.kv_blocks,
                kv_used_blocks=self.options.worker.kv_blocks - engine.free_blocks, kv_cached_blocks=0,
                prompt_tokens_total=w.uncached_total, cached_tokens_total=0, generated_tokens_total=0,
                pending_prefill_tokens=engine.pending_prefill_tokens(),
                computed_prompt_tokens_total=engine.computed_prompt_tokens))
            history[:] = [s for s in history if s.ts >= now - setup.window_s]
            loads[w.worker_id] = history
        self.samples = [s for s in self.samples if s.at >= now - setup.window_s]
        self.measured.update(measured_prefill_rates(members, loads))
        snapshot = build_snapshot(members, loads, self.samples, [], prefill_capacity_tok_s=setup.prefill_capacity_tok_s,
                                  measured_prefill_tok_s=self.measured, since=self.state.last_action_at)
        decision = decide(snapshot, setup.slos, self.state, now, setup.config)
        self.state = decision.state
        for action in decision.actions:
            self.actions.append({"at_s": round(now, 2), "action": type(action).__name__, "reason": action.reason,
                                 "pressures": decision.pressures})
            match action:
                case SwitchRole(worker_id=worker_id, to_role=role):
                    next(w for w in self.workers if w.worker_id == worker_id).role = role
                case ScaleUp(role=role):
                    self._launch(role, now, ready_at=now + setup.start_s)
                case ScaleDown(worker_id=worker_id):
                    worker = next(w for w in self.workers if w.worker_id == worker_id)
                    worker.draining = True
                    if not worker.engine.has_work and worker.assigned == 0:
                        worker.exited_at = now
