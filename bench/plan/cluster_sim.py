"""A discrete-event simulation of a disaggregated cluster of sim workers (pure, faster than
real time): the planner's what-if model and `tandem plan`'s predictor.

One request's walk, as the router runs it in pull mode (`services.router.flows.handoff`):
arrival; the router picks a prefill worker (least cost: uncached prompt tokens plus
`queue_weight` x its queued prefill tokens, the router's own weights, so a worker holding
the shared prefix wins when its queue allows) and a decode worker (fewest requests
assigned); the prefill worker computes the prompt and samples the first token; the decode
worker gets the prompt and that token, the prompt's full blocks arrive by KV transfer, it
computes the rest of the last block and decodes the remaining tokens. Each worker is an
`EngineModel` stepping on the sim's timing profile. `StackOverheads` adds what the real
stack costs on top of engine time (HTTP and NATS hops, the KV hand-off, per-step Python
work), in real milliseconds, unscaled by the sim's speed-up.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

import msgspec

from bench.plan.engine_model import EngineModel, SeqModel
from bench.plan.workload import Arrival, PlanWorkload, arrivals
from bench.serve.stats import distribution_ms
from services.router.config import RoutingConfig
from services.worker.sim.profile import TimingProfile
from shared.config import WorkerConfig


class StackOverheads(msgspec.Struct, frozen=True, kw_only=True):
    """Real time the stack adds to the engine's steps (see docs/planner.md for how they were measured)."""

    # The router is one event loop every request and every streamed chunk passes through: a
    # FIFO server. Its service time per request (HTTP, tokenizing, routing, sending) ...
    router_ms: float = 0.0
    router_chunk_ms: float = 0.0  # ... and per chunk streamed back (frame, detokenize, SSE)
    delivery_ms: float = 0.0  # a token sampled -> at the client
    handoff_ms: float = 0.0  # first token sampled -> the request queued at the decode worker
    pull_block_ms: float = 0.0  # per pulled block: the decode worker's loop busy reading and verifying it
    step_ms: float = 0.0  # per engine step (scheduler and asyncio work)
    seq_ms: float = 0.0  # per sequence in a step (its token published and streamed)
    prefill_token_ms: float = 0.0  # per prompt token computed (hashing, KV bytes written, prompt carried)
    # share of tokens whose text is empty (an incomplete UTF-8 or word piece): the client sees
    # them with the next chunk, one inter-chunk gap longer, as the benchmark measures ITL; a
    # textless first token puts TTFT at the second, past the hand-off
    textless_share: float = 0.0
    # mean of an exponential wait added to each hop a token or request makes between processes
    # (an oversubscribed CPU's run queue): widens the tails, not the medians' engine time
    hop_jitter_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class ClusterShape:
    prefill: int
    decode: int

    @property
    def name(self) -> str:
        return f"{self.prefill}p{self.decode}d"

    @property
    def total(self) -> int:
        return self.prefill + self.decode


@dataclass(slots=True)
class RequestTrace:
    arrival: Arrival
    token_at: list[float] = field(default_factory=list)  # client-side arrival of each chunk with text
    chunks_merged: int = 0

    @property
    def ttft_s(self) -> float:
        return self.token_at[0] - self.arrival.at_s

    @property
    def itl_s(self) -> list[float]:
        return [later - earlier for earlier, later in zip(self.token_at, self.token_at[1:])]


@dataclass(frozen=True, slots=True)
class SimSetup:
    profile: TimingProfile
    worker: WorkerConfig = field(default_factory=lambda: WorkerConfig(worker_id="sim"))
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    speedup: float = 1.0
    overheads: StackOverheads = StackOverheads()


class _Cluster:
    def __init__(self, shape: ClusterShape, setup: SimSetup) -> None:
        def engine(name: str) -> EngineModel:
            overheads = setup.overheads
            return EngineModel(name, setup.profile, setup.worker, speedup=setup.speedup,
                               step_overhead_s=overheads.step_ms / 1000, seq_overhead_s=overheads.seq_ms / 1000,
                               prefill_token_overhead_s=overheads.prefill_token_ms / 1000)

        self.setup = setup
        self.prefill = [engine(f"prefill-{index}") for index in range(shape.prefill)]
        self.decode = [engine(f"decode-{index}") for index in range(shape.decode)]
        self.decode_assigned = [0] * shape.decode
        self.prefix_holders: set[int] = set()  # prefill workers that computed the shared prefix
        self.events: list[tuple[float, int, str, object]] = []
        self.sequence = 0
        self.traces: dict[int, RequestTrace] = {}
        self.decode_of: dict[int, int] = {}
        self.textless = random.Random(0)
        self.noise = random.Random(1)
        self.router_free = 0.0

    def _jitter(self) -> float:
        mean_ms = self.setup.overheads.hop_jitter_ms
        return self.noise.expovariate(1000 / mean_ms) if mean_ms > 0 else 0.0

    def _through_router(self, at: float, service_ms: float) -> float:
        """When the router is done with work that reaches it at `at` (FIFO)."""
        self.router_free = max(at, self.router_free) + service_ms / 1000
        return self.router_free

    def push(self, at: float, kind: str, payload: object) -> None:
        self.sequence += 1
        heapq.heappush(self.events, (at, self.sequence, kind, payload))

    def run(self, requests: list[Arrival]) -> list[RequestTrace]:
        overheads = self.setup.overheads
        for arrival in requests:
            self.traces[arrival.index] = RequestTrace(arrival)
            self.push(arrival.at_s + self._jitter(), "arrive", arrival)
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrive":
                self.push(self._through_router(now, overheads.router_ms), "route", payload)
            elif kind == "route":
                assert isinstance(payload, Arrival)
                self._route(now, payload)
            elif kind == "handoff":
                assert isinstance(payload, SeqModel)
                engine = self.decode[self.decode_of[payload.request]]
                blocks = payload.reused_tokens // self.setup.worker.block_size
                engine.stall_s += blocks * self.setup.overheads.pull_block_ms / 1000
                self._enqueue(now, engine, payload)
            else:
                assert isinstance(payload, tuple)
                self._step_end(now, *payload)
        return [self.traces[index] for index in sorted(self.traces)]

    def _route(self, now: float, arrival: Arrival) -> None:
        size, weight = self.setup.worker.block_size, self.setup.routing.queue_weight

        def cost(index: int) -> tuple[float, int]:
            hit = arrival.prefix_tokens // size * size if index in self.prefix_holders else 0
            return arrival.prompt_tokens - hit + weight * self.prefill[index].pending_prefill_tokens(), index

        chosen = min(range(len(self.prefill)), key=cost)
        reused = 0
        if arrival.prefix_tokens:
            if chosen in self.prefix_holders:  # at most the full blocks before the last token
                reused = min(arrival.prefix_tokens // size, (arrival.prompt_tokens - 1) // size) * size
            self.prefix_holders.add(chosen)
        decode = min(range(len(self.decode)), key=lambda index: (self.decode_assigned[index], index))
        self.decode_assigned[decode] += 1
        self.decode_of[arrival.index] = decode
        seq = SeqModel(request=arrival.index, num_tokens=arrival.prompt_tokens, outputs_left=1, reused_tokens=reused)
        self._enqueue(now, self.prefill[chosen], seq)

    def _enqueue(self, now: float, engine: EngineModel, seq: SeqModel) -> None:
        engine.add(seq)
        if not engine.stepping:
            self._start_step(now, engine)

    def _start_step(self, now: float, engine: EngineModel) -> None:
        plan = engine.step()
        if plan.duration_s == 0 and not plan.sampled:
            engine.stepping = False  # nothing fits: wait for the next arrival
            return
        engine.stepping = True
        self.push(now + plan.duration_s, "step", (engine, plan.sampled))

    def _step_end(self, now: float, engine: EngineModel, sampled: list[tuple[SeqModel, bool]]) -> None:
        overheads = self.setup.overheads
        for seq, finished in sampled:
            trace = self.traces[seq.request]
            last = finished and engine in self.decode
            if not last and self.textless.random() < overheads.textless_share:
                trace.chunks_merged += 1  # no chunk for this token: its gap joins the next one's
            else:
                at = self._through_router(now + overheads.delivery_ms / 1000, overheads.router_chunk_ms)
                trace.token_at.append(at + self._jitter())
            if engine in self.prefill:
                arrival = trace.arrival
                if arrival.output_tokens > 1:  # the decode part: prompt + first token, blocks pulled
                    size = self.setup.worker.block_size
                    pulled = arrival.prompt_tokens // size * size
                    handed = SeqModel(request=seq.request, num_tokens=arrival.prompt_tokens + 1,
                                      outputs_left=arrival.output_tokens - 1, reused_tokens=pulled)
                    self.push(now + overheads.handoff_ms / 1000 + self._jitter(), "handoff", handed)
                else:
                    self.decode_assigned[self.decode_of[seq.request]] -= 1
            elif finished:
                self.decode_assigned[self.decode_of[seq.request]] -= 1
        if engine.has_work:
            self._start_step(now, engine)
        else:
            engine.stepping = False


def simulate(workload: PlanWorkload, shape: ClusterShape, setup: SimSetup) -> list[RequestTrace]:
    """Every request's token times on `shape` (the workload's own arrival instants)."""
    assert shape.prefill >= 1 and shape.decode >= 1
    return _Cluster(shape, setup).run(arrivals(workload))


def figures(traces: list[RequestTrace]) -> dict:
    """TTFT, ITL and end-to-end distributions in ms, as `tandem bench serve` reports them."""
    done = [trace for trace in traces if trace.token_at]
    return {"requests": len(traces), "completed": len(done),
            "ttft_ms": distribution_ms([trace.ttft_s for trace in done]),
            "itl_ms": distribution_ms([gap for trace in done for gap in trace.itl_s]),
            "e2e_ms": distribution_ms([trace.token_at[-1] - trace.arrival.at_s for trace in done])}
