"""A seeded family of prefix-sharing workloads for the routing sweep (pure, no I/O).

One `SweepPoint` describes a workload: tenants with shared prefixes (few-large to
many-small), their popularity (Zipf; exponent 0 is uniform), how much of the cluster's KV
the live shared prefixes need (`kv_pressure`, sizes the workers' pools), a share of unique
prompts, multi-turn conversations, and arrivals: open loop (Poisson, on/off bursts, batch
bursts) or closed loop (users with think time), at `load` x the cluster's cache-blind
capacity (`EngineShape`). `size_point` turns a point and an engine shape into the numbers
a run needs; `open_sessions`, `lane_session` and `warmup_sessions` give the requests, the
same for every arm given the seed.

A `Session` is what one client lane sends in sequence: one request, or the turns of a
conversation (turn N+1 is turn N's prompt + the sim's predicted answer + a new user
message, as in `ConversationsWorkload`). Every session carries its `group`: the tenant
(`tenant-3`), the conversation (`conv-2-7`), or None for a unique prompt, which is what the
oracle (`bench.routing.oracle`) routes by. Called by `bench.routing.sweep` and
`bench.routing.sweep_drive`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bench.routing.workloads import EngineShape, answer_tokens, random_tokens
from services.worker.sim.tokens import fold_tokens

ARRIVALS = ("poisson", "onoff", "batch", "closed")


@dataclass(frozen=True, slots=True)
class SweepPoint:
    name: str
    tenants: int = 8  # shared-prefix groups; 0 with turns > 1 (each conversation is its group)
    prefix_tokens: int = 1024  # a tenant's shared prefix, or a conversation's first prompt
    query_tokens: int = 64  # mean unique suffix per request (uniform in [q/2, 3q/2]); a later turn's message
    max_tokens: int = 16  # answer length
    zipf: float = 0.0  # tenant popularity ~ 1 / rank**zipf; 0 is uniform
    kv_pressure: float = 0.7  # live shared-prefix tokens / cluster KV capacity
    unique_share: float = 0.0  # share of sessions that are one prompt sharing no prefix
    turns: int = 1  # > 1: multi-turn conversations
    arrivals: str = "poisson"  # one of ARRIVALS
    load: float = 0.9  # offered request rate / cache-blind capacity
    think_s: float = 0.5  # simulated think time between an answer and the next send (closed loop, turns)
    burst_on_s: float = 1.0  # onoff: wall seconds of arrivals, then burst_off_s of none
    burst_off_s: float = 1.0
    batch_size: int = 8  # batch: requests that arrive at the same instant
    host_tier: float = 0.0  # > 0: each worker keeps a host-memory KV tier this many times its KV pool

    def check(self, max_model_len: int) -> None:
        """Raise ValueError on a point that cannot run."""
        if self.arrivals not in ARRIVALS:
            raise ValueError(f"point {self.name}: arrivals must be one of {ARRIVALS}, got {self.arrivals!r}")
        if self.turns < 1 or self.prefix_tokens < 1 or self.query_tokens < 1 or self.max_tokens < 1:
            raise ValueError(f"point {self.name}: turns, prefix, query and answer lengths must be >= 1")
        if self.turns > 1 and self.tenants:
            raise ValueError(f"point {self.name}: multi-turn conversations are their own groups (tenants=0)")
        if self.turns == 1 and self.tenants < 1 and self.unique_share < 1:
            raise ValueError(f"point {self.name}: single-turn points need tenants")
        if not 0 <= self.unique_share <= 1 or self.zipf < 0 or self.kv_pressure <= 0 or self.load <= 0:
            raise ValueError(f"point {self.name}: unique_share in [0, 1], zipf >= 0, kv_pressure and load > 0")
        if self.host_tier < 0:
            raise ValueError(f"point {self.name}: host_tier must not be negative")
        longest = self.prompt_tokens(self.turns - 1) + self.query_tokens // 2 + self.max_tokens
        if longest > max_model_len:
            raise ValueError(f"point {self.name}: the longest request needs {longest} tokens; "
                             f"max_model_len is {max_model_len}")

    @property
    def closed_loop(self) -> bool:
        return self.arrivals == "closed"

    def prompt_tokens(self, turn: int) -> int:
        """Mean prompt tokens of turn `turn` (0-based)."""
        return self.prefix_tokens + self.query_tokens + turn * (self.query_tokens + self.max_tokens)

    @property
    def mean_session_requests(self) -> float:
        return self.unique_share + (1 - self.unique_share) * self.turns

    @property
    def mean_prompt_tokens(self) -> float:
        """Over requests; a unique prompt is as long as a first turn."""
        grouped = (1 - self.unique_share) * sum(self.prompt_tokens(turn) for turn in range(self.turns))
        return (grouped + self.unique_share * self.prompt_tokens(0)) / self.mean_session_requests

    def popularity(self) -> list[float]:
        """Each tenant's share of the tenant sessions (sums to 1)."""
        weights = [1.0 / (rank + 1) ** self.zipf for rank in range(self.tenants)]
        total = sum(weights)
        return [weight / total for weight in weights]

    def group_shares(self) -> dict[str, float]:
        """Each tenant's share of all requests (unique prompts are in no group)."""
        return {f"tenant-{index}": (1 - self.unique_share) * share for index, share in enumerate(self.popularity())}


@dataclass(frozen=True, slots=True)
class PointSizing:
    """What a run of a point on `shape` needs: workers' pools and the offered load."""

    kv_blocks: int  # per worker
    kv_tokens_per_worker: int
    rate_rps: float  # requests per wall second offered (open loop) or aimed at (closed loop)
    session_rate: float  # sessions per wall second (open loop)
    users: int  # closed loop lanes; 0 for open loop
    cycle_s: float  # wall seconds from an answer to the next send of a lane, answer included
    live_prefix_tokens: float  # the shared-prefix tokens that kv_pressure sizes against
    live_conversations: float  # conversations under way at once (0 if single-turn)
    conversation_tokens: int  # a conversation's context at its last answer (0 if single-turn)
    kv_host_blocks: int = 0  # per worker, in its host-memory tier (0: none)


def _cycle_s(point: SweepPoint, shape: EngineShape) -> float:
    answer_ms = point.max_tokens * (shape.profile.decode_base_ms + shape.profile.step_overhead_ms)
    return (point.think_s + answer_ms / 1000.0) / shape.sim_speedup


def size_point(point: SweepPoint, shape: EngineShape) -> PointSizing:
    rate = point.load * shape.cache_blind_capacity_rps(point.mean_prompt_tokens)
    cycle = _cycle_s(point, shape)
    users = max(1, round(rate * cycle)) if point.closed_loop else 0
    session_rate = rate / point.mean_session_requests
    conversation = point.prompt_tokens(point.turns - 1) + point.max_tokens if point.turns > 1 else 0
    conversations = 0.0
    if point.turns > 1:  # live conversations (Little's law), each holding its context
        grouped = 1 - point.unique_share
        conversations = max(1.0, users * grouped if users else session_rate * grouped * point.turns * cycle)
        mean_context = (point.prefix_tokens + point.query_tokens
                        + (point.turns - 1) / 2 * (point.query_tokens + point.max_tokens))
        live = conversations * (mean_context + point.max_tokens)
    else:
        live = float(point.tenants * point.prefix_tokens)
    blocks = shape.kv_blocks_for(live, point.kv_pressure)
    return PointSizing(kv_blocks=blocks, kv_tokens_per_worker=blocks * shape.block_size, rate_rps=rate,
                       session_rate=session_rate, users=users, cycle_s=cycle, live_prefix_tokens=live,
                       live_conversations=conversations, conversation_tokens=conversation,
                       kv_host_blocks=round(blocks * point.host_tier))


@dataclass(frozen=True, slots=True)
class Turn:
    prompt: list[int]
    max_tokens: int
    think_s: float  # wall seconds after the previous answer of its lane (0: at once)


@dataclass(frozen=True, slots=True)
class Session:
    group: str | None  # tenant or conversation; None for a unique prompt
    turns: tuple[Turn, ...]
    start_s: float = 0.0  # open loop: offset from the start of the run


def arrival_times(rng: np.random.Generator, point: SweepPoint, session_rate: float, duration_s: float) -> list[float]:
    """Session start offsets in [0, duration_s): the same mean rate for every kind of burst."""
    times: list[float] = []
    if point.arrivals == "batch":  # batches of batch_size arrive as a Poisson process
        at = float(rng.exponential(point.batch_size / session_rate))
        while at < duration_s:
            times.extend([at] * point.batch_size)
            at += float(rng.exponential(point.batch_size / session_rate))
        return times
    period = point.burst_on_s + point.burst_off_s
    # onoff: arrivals only in the first burst_on_s of each period, at a rate that keeps the mean
    on_rate = session_rate * period / point.burst_on_s if point.arrivals == "onoff" else session_rate
    busy = float(rng.exponential(1.0 / on_rate))  # offset in "on" time
    while True:
        at = (busy // point.burst_on_s) * period + busy % point.burst_on_s if point.arrivals == "onoff" else busy
        if at >= duration_s:
            return times
        times.append(at)
        busy += float(rng.exponential(1.0 / on_rate))


def _query(rng: np.random.Generator, mean: int, vocab_size: int) -> list[int]:
    low, high = max(1, mean // 2), max(1, mean * 3 // 2)
    return random_tokens(rng, int(rng.integers(low, high + 1)), vocab_size)


def tenant_prefixes(point: SweepPoint, vocab_size: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng([seed, 11])
    return [random_tokens(rng, point.prefix_tokens, vocab_size) for _ in range(point.tenants)]


def conversation_turns(point: SweepPoint, vocab_size: int, seed: int, key: tuple[int, ...],
                       think: list[float]) -> tuple[Turn, ...]:
    """A conversation's turns: each prompt is the previous one + the predicted answer + a message."""
    rng = np.random.default_rng([seed, 13, *key])
    prompt = random_tokens(rng, point.prefix_tokens, vocab_size) + _query(rng, point.query_tokens, vocab_size)
    state = fold_tokens(prompt)
    turns = [Turn(prompt, point.max_tokens, think[0])]
    for turn in range(1, point.turns):
        answer, state = answer_tokens(state, point.max_tokens, vocab_size)
        message = _query(rng, point.query_tokens, vocab_size)
        state = fold_tokens(message, state)
        prompt = prompt + answer + message
        turns.append(Turn(prompt, point.max_tokens, think[turn]))
    return tuple(turns)


class SessionMaker:
    """The sessions of one point: which kind each is, and its prompts (seeded by its key)."""

    def __init__(self, point: SweepPoint, shape: EngineShape, vocab_size: int, seed: int) -> None:
        self.point, self.shape, self.vocab_size, self.seed = point, shape, vocab_size, seed
        self.prefixes = tenant_prefixes(point, vocab_size, seed) if point.tenants else []
        self.popularity = point.popularity() if point.tenants else []

    def think_wall_s(self, rng: np.random.Generator) -> float:
        return float(rng.exponential(self.point.think_s)) / self.shape.sim_speedup

    def session(self, key: tuple[int, ...], first_think_s: float, start_s: float = 0.0) -> Session:
        point, vocab = self.point, self.vocab_size
        rng = np.random.default_rng([self.seed, 12, *key])
        if rng.random() < point.unique_share:
            prompt = random_tokens(rng, point.prefix_tokens, vocab) + _query(rng, point.query_tokens, vocab)
            return Session(None, (Turn(prompt, point.max_tokens, first_think_s),), start_s)
        if point.turns > 1:
            think = [first_think_s] + [self.think_wall_s(rng) for _ in range(point.turns - 1)]
            return Session("conv-" + "-".join(map(str, key)),
                           conversation_turns(point, vocab, self.seed, key, think), start_s)
        tenant = int(rng.choice(point.tenants, p=self.popularity))
        prompt = self.prefixes[tenant] + _query(rng, point.query_tokens, vocab)
        return Session(f"tenant-{tenant}", (Turn(prompt, point.max_tokens, first_think_s),), start_s)


def open_sessions(point: SweepPoint, shape: EngineShape, sizing: PointSizing, vocab_size: int, seed: int,
                  duration_s: float) -> list[Session]:
    """Open loop: sessions starting at the point's arrival times over `duration_s`."""
    maker = SessionMaker(point, shape, vocab_size, seed)
    times = arrival_times(np.random.default_rng([seed, 14]), point, sizing.session_rate, duration_s)
    return [maker.session((0, index), 0.0, at) for index, at in enumerate(times)]


def lane_session(maker: SessionMaker, lane: int, index: int) -> Session:
    """Closed loop: the `index`-th session of user `lane`, its first turn after a think time."""
    think = maker.think_wall_s(np.random.default_rng([maker.seed, 15, lane, index]))
    return maker.session((lane + 1, index), think)


def warmup_sessions(point: SweepPoint, vocab_size: int, seed: int) -> list[Session]:
    """One request per tenant (not measured): every shared prefix is cached somewhere."""
    rng = np.random.default_rng([seed, 16])
    return [Session(f"tenant-{index}", (Turn(prefix + _query(rng, point.query_tokens, vocab_size),
                                             point.max_tokens, 0.0),))
            for index, prefix in enumerate(tenant_prefixes(point, vocab_size, seed))]


# ---- the sweeps: sized for a 4-worker sim cluster on a small machine -----------------------------

DEFAULT_SWEEP: tuple[SweepPoint, ...] = (
    SweepPoint("few-large", tenants=4, prefix_tokens=1536, kv_pressure=0.7),
    SweepPoint("many-small", tenants=24, prefix_tokens=384, kv_pressure=0.7, load=0.5),
    SweepPoint("zipf-closed", tenants=16, prefix_tokens=768, zipf=1.1, kv_pressure=0.7, arrivals="closed"),
    SweepPoint("roomy", tenants=8, prefix_tokens=1024, kv_pressure=0.3),
    SweepPoint("overfull", tenants=12, prefix_tokens=1024, zipf=0.8, kv_pressure=1.2),
    SweepPoint("multi-turn", tenants=0, prefix_tokens=512, query_tokens=64, max_tokens=32, turns=5,
               kv_pressure=0.7, arrivals="closed"),
    SweepPoint("half-unique", tenants=8, prefix_tokens=1024, unique_share=0.5, kv_pressure=0.5, load=0.7),
    SweepPoint("bursts", tenants=8, prefix_tokens=1024, kv_pressure=0.7, arrivals="onoff"),
)
# KV tiers: the hot prefixes need twice the cluster's device KV (a small first tier forced), each
# worker keeps three times its pool in host memory; run with the kv-aware and kv-tier-blind arms
# (bench/results/kv-tiers-sim.md)
TIER_SWEEP: tuple[SweepPoint, ...] = (
    SweepPoint("tiered", tenants=32, prefix_tokens=512, zipf=0.8, kv_pressure=2.0, host_tier=3.0, load=0.6),
)
QUICK_SWEEP: tuple[SweepPoint, ...] = tuple(point for point in DEFAULT_SWEEP
                                            if point.name in ("few-large", "many-small", "multi-turn"))
DEFAULT_DURATION_S = 10.0
QUICK_DURATION_S = 6.0


def at_load(points: Sequence[SweepPoint], load: float) -> list[SweepPoint]:
    """`points` offered `load` x their cache-blind capacity instead of their own load: an
    engine whose decode is cheap beside its prefill (vLLM on CPU) queues little at a point's
    own load once most of each prompt is cached."""
    return [dataclasses.replace(point, load=load) for point in points]


def points_named(names: list[str], points: tuple[SweepPoint, ...] = DEFAULT_SWEEP + TIER_SWEEP) -> list[SweepPoint]:
    known = {point.name: point for point in points}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"unknown sweep points {unknown}; choose from {', '.join(known)}")
    return [known[name] for name in names]

