"""Workloads for the routing benchmark (`bench.routing`): pure, seeded, no I/O.

Two shapes, both as token-id prompts so that prefixes are exact:

- `TenantsWorkload`: many tenants, each with a long shared prefix (a system prompt, a
  document) and short unique queries; open-loop Poisson arrivals, tenants drawn uniformly.
- `ConversationsWorkload`: conversations whose turn N+1 is turn N's prompt + its answer +
  a new user message; a fixed population of users (closed loop), each turn an exponential
  think time after the previous answer.

Sizing is derived from the sim's timing profile (`services/worker/sim/profile.py`), so the
same flags give the same pressure on any machine: the KV pool is sized so the workload's
live prefixes fill a chosen fraction of the cluster's KV capacity, and the request rate is
a chosen fraction of what the cluster could serve if nothing were cached (the load a
cache-blind router sees). `answer_tokens` predicts the sim's greedy output, so a client can
extend a conversation with the exact tokens the engine produced. `RunLog` turns the
client's per-request outcomes into a result row's figures.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from bench.routing.fleet_shapes import WorkerShape
from services.worker.sim.profile import TimingProfile
from services.worker.sim.tokens import DEFAULT_FIRST_NORMAL_TOKEN, fold_token, next_token
from shared.schemas.generate import SamplingParams


@dataclass(frozen=True, slots=True)
class EngineShape:
    """What the workers are configured with (the worker flags the benchmark passes)."""

    workers: int
    block_size: int
    max_num_batched_tokens: int
    max_model_len: int
    profile: TimingProfile
    sim_speedup: float
    mix: tuple[WorkerShape, ...] = ()  # the workers' shapes in turn (`fleet_shapes`); empty: all alike

    def uncached_request_s(self, prompt_tokens: float) -> float:
        """Wall seconds one worker spends prefilling a prompt from scratch when it is busy:
        chunked prefill, each chunk's step also carrying the running decodes."""
        profile = self.profile
        steps = math.ceil(prompt_tokens / self.max_num_batched_tokens)
        ms = prompt_tokens * profile.prefill_ms_per_token + steps * (profile.step_overhead_ms + profile.decode_base_ms)
        return ms / 1000.0 / self.sim_speedup

    def cache_blind_capacity_rps(self, prompt_tokens: float) -> float:
        """Requests per wall second the cluster serves when no prompt token is reused."""
        return self.workers / self.uncached_request_s(prompt_tokens)

    def kv_blocks_for(self, live_tokens: float, kv_fill: float) -> int:
        """Blocks per worker such that `live_tokens` of prefixes fill `kv_fill` of the cluster."""
        blocks = math.ceil(live_tokens / self.block_size / (kv_fill * self.workers))
        # a worker must at least fit one request of the longest allowed context
        return max(blocks, math.ceil(self.max_model_len / self.block_size) + 1)


@dataclass(frozen=True, slots=True)
class TimedRequest:
    at_s: float  # offset from the start of the run
    prompt: list[int]
    max_tokens: int
    tag: str  # tenant or conversation id, for progress lines only


def random_tokens(rng: np.random.Generator, count: int, vocab_size: int) -> list[int]:
    return rng.integers(DEFAULT_FIRST_NORMAL_TOKEN, vocab_size, size=count).tolist()


def _poisson_times(rng: np.random.Generator, rate_rps: float, duration_s: float) -> list[float]:
    times: list[float] = []
    at = float(rng.exponential(1.0 / rate_rps))
    while at < duration_s:
        times.append(at)
        at += float(rng.exponential(1.0 / rate_rps))
    return times


@dataclass(frozen=True, slots=True)
class TenantsWorkload:
    tenants: int = 16
    prefix_tokens: int = 1536
    query_tokens: int = 64  # mean; uniform in [query/2, 3*query/2]
    max_tokens: int = 16
    kv_fill: float = 0.7  # share of the cluster's KV the tenants' prefixes need
    load: float = 0.9  # offered rate / cache-blind capacity

    @property
    def mean_prompt_tokens(self) -> float:
        return self.prefix_tokens + self.query_tokens

    def kv_blocks(self, shape: EngineShape) -> int:
        return shape.kv_blocks_for(self.tenants * self.prefix_tokens, self.kv_fill)

    def rate_rps(self, shape: EngineShape) -> float:
        return self.load * shape.cache_blind_capacity_rps(self.mean_prompt_tokens)

    def prefixes(self, vocab_size: int, seed: int) -> list[list[int]]:
        rng = np.random.default_rng([seed, 1])
        return [random_tokens(rng, self.prefix_tokens, vocab_size) for _ in range(self.tenants)]

    def _query(self, rng: np.random.Generator, vocab_size: int) -> list[int]:
        low, high = max(1, self.query_tokens // 2), max(1, self.query_tokens * 3 // 2)
        return random_tokens(rng, int(rng.integers(low, high + 1)), vocab_size)

    def warmup(self, vocab_size: int, seed: int) -> list[TimedRequest]:
        """One request per tenant (not measured): every prefix is cached somewhere."""
        rng = np.random.default_rng([seed, 2])
        return [TimedRequest(0.0, prefix + self._query(rng, vocab_size), self.max_tokens, f"tenant-{index}")
                for index, prefix in enumerate(self.prefixes(vocab_size, seed))]

    def requests(self, vocab_size: int, seed: int, rate_rps: float, duration_s: float) -> list[TimedRequest]:
        prefixes = self.prefixes(vocab_size, seed)
        rng = np.random.default_rng([seed, 3])
        requests = []
        for at in _poisson_times(rng, rate_rps, duration_s):
            tenant = int(rng.integers(self.tenants))
            requests.append(TimedRequest(at, prefixes[tenant] + self._query(rng, vocab_size), self.max_tokens,
                                         f"tenant-{tenant}"))
        return requests


@dataclass(frozen=True, slots=True)
class ConversationsWorkload:
    """Closed loop, like a chat front end: `users(shape)` users each hold one conversation
    at a time, send its next turn an exponential think time after the previous answer, and
    start a new conversation after the last turn. The number of users is what offers
    `load` x the cache-blind capacity when answers come back promptly."""

    first_tokens: int = 768  # system prompt + first user message, unique per conversation
    user_tokens: int = 64  # each later user message
    max_tokens: int = 32  # each answer
    turns: int = 6
    think_s: float = 0.5  # mean simulated think time between an answer and the next turn
    kv_fill: float = 0.7  # share of the cluster's KV the live conversations need
    load: float = 0.9  # offered rate / cache-blind capacity

    def prompt_tokens(self, turn: int) -> int:
        """Tokens of the prompt of turn `turn` (0-based)."""
        return self.first_tokens + turn * (self.user_tokens + self.max_tokens)

    @property
    def mean_prompt_tokens(self) -> float:
        return sum(self.prompt_tokens(turn) for turn in range(self.turns)) / self.turns

    def check(self, max_model_len: int) -> None:
        longest = self.prompt_tokens(self.turns - 1) + self.max_tokens
        if longest > max_model_len:
            raise ValueError(f"the last turn needs {longest} tokens of context; max_model_len is {max_model_len}")

    def rate_rps(self, shape: EngineShape) -> float:
        """Turns per wall second, when answers come back promptly."""
        return self.load * shape.cache_blind_capacity_rps(self.mean_prompt_tokens)

    def cycle_s(self, shape: EngineShape) -> float:
        """Wall seconds from one turn to the next of a user: think time plus a cached answer."""
        answer_ms = self.max_tokens * (shape.profile.decode_base_ms + shape.profile.step_overhead_ms)
        return (self.think_s + answer_ms / 1000.0) / shape.sim_speedup

    def users(self, shape: EngineShape) -> int:
        return max(1, round(self.rate_rps(shape) * self.cycle_s(shape)))

    def kv_blocks(self, shape: EngineShape) -> int:
        return shape.kv_blocks_for(self.users(shape) * (self.mean_prompt_tokens + self.max_tokens), self.kv_fill)

    def think_wall_s(self, rng: np.random.Generator, sim_speedup: float) -> float:
        return float(rng.exponential(self.think_s)) / sim_speedup

    def first_prompt(self, vocab_size: int, seed: int, conversation: int) -> list[int]:
        return random_tokens(np.random.default_rng([seed, 5, conversation]), self.first_tokens, vocab_size)

    def user_message(self, vocab_size: int, seed: int, conversation: int, turn: int) -> list[int]:
        return random_tokens(np.random.default_rng([seed, 6, conversation, turn]), self.user_tokens, vocab_size)


def answer_tokens(history_state: int, max_tokens: int, vocab_size: int) -> tuple[list[int], int]:
    """The sim's greedy answer (with `ignore_eos`) to the history whose fold is
    `history_state` (`tokens.fold_tokens`), and the state after it: the sim's output is a
    function of the tokens only, whichever worker computes it."""
    sampling = SamplingParams(max_tokens=max_tokens)
    answer = []
    for _ in range(max_tokens):
        token = next_token(history_state, sampling, vocab_size)
        answer.append(token)
        history_state = fold_token(history_state, token)
    return answer, history_state


def percentile_ms(values_s: list[float], q: float) -> float | None:
    if not values_s:
        return None
    return round(float(np.percentile(np.asarray(values_s), q)) * 1000.0, 2)


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it (times from `time.monotonic()`)."""

    sent_at: float
    ttft_s: float | None = None
    ended_at: float | None = None
    completion_tokens: int = 0
    text: str = ""
    error: str | None = None


@dataclass
class RunLog:
    """The measured requests of one run, and the row figures they give."""

    outcomes: list[Outcome] = field(default_factory=list)

    def summary(self) -> dict:
        done = [outcome for outcome in self.outcomes if outcome.error is None and outcome.ended_at is not None]
        failed = [outcome.error or "unfinished" for outcome in self.outcomes
                  if outcome.error is not None or outcome.ended_at is None]
        # every first token counts, also of a request that failed later; one that never got a
        # first token is only an error (the percentiles then understate the tail: see `errors`)
        ttfts = [outcome.ttft_s for outcome in self.outcomes if outcome.ttft_s is not None]
        span_s = (max(outcome.ended_at for outcome in done) - min(outcome.sent_at for outcome in self.outcomes)
                  if done else 0.0)
        tokens = sum(outcome.completion_tokens for outcome in done)
        return {
            "requests": len(self.outcomes),
            "ttft_p50_ms": percentile_ms(ttfts, 50),
            "ttft_p90_ms": percentile_ms(ttfts, 90),
            "ttft_p99_ms": percentile_ms(ttfts, 99),
            "throughput_tok_s": round(tokens / span_s, 1) if span_s > 0 else 0.0,
            "errors": len(failed),
            "error_kinds": dict(Counter(failed)),
        }
