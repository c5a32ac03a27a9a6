"""The router's routing of one request, in-process: `RoutingState.ask` then `commit` (the KV
index's look-up, the workers' views, `decide`, the commit: ledger, KV predictions, placement),
as `SourceOpener._route` runs them for a request that is routed at once. Two uses, on whichever
tree it runs from (`cd <tree> && PYTHONPATH=. python bench/router/route_micro.py [runs]`):

- its CPU (`time.thread_time`) per request, median of `runs`;
- `decisions(seed)`: the decisions of one seeded run (worker, flow, reason, cost, prompt
  plan), which a change that must not change any decision compares before and after
  (`tests/unit/test_router_route_replay.py` keeps a digest of them).

The workload: the workers of one of `FLEETS` (the bench's 2, 4, a disaggregated 5), prompts of a few shared prefixes and a random
tail, 32 requests in flight (each one's first token after a few more are routed, its end a few
later), a load report per worker every 250 requests, the KV events of the blocks the routed
worker now holds, and a clock that moves 1 ms per request (predictions expire).
"""

from __future__ import annotations

import hashlib
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Iterator

from opentelemetry.trace import INVALID_SPAN

from services.router.config import RoutingConfig
from services.router.fleet.worker_pool import WorkerPool
from services.router.flows.records import GenerationParams
from services.router.flows.routing_state import Attempt, RoutedPrompts, RoutingState
from services.router.kv.view import KvView
from services.router.metrics import RouterMetrics
from services.router.routing import build_policy
from services.router.routing.placement.placement import Placements
from shared.block_hash import block_hash_chain
from shared.codec import MalformedCounter, encode
from shared.schemas import LoadSnapshot, SamplingParams, WorkerCapacity, WorkerRegistration
from shared.schemas.kv_events import BlockStored, KvEventBatch
from shared.schemas.membership import WorkerRole
from shared.subjects import Subjects

BOTH, PREFILL, DECODE = WorkerRole.BOTH, WorkerRole.PREFILL, WorkerRole.DECODE
FLEETS = ((BOTH, BOTH), (BOTH,) * 4, (PREFILL, PREFILL, DECODE, DECODE, BOTH))  # the workers' roles
BLOCK = 16
IN_FLIGHT = 32
REQUESTS = 4000


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _stack(clock: _Clock, roles: tuple[WorkerRole, ...]) -> tuple[RoutingState, WorkerPool, KvView]:
    malformed, routing = MalformedCounter(), RoutingConfig()
    kv_view = KvView(None, Subjects(), malformed)  # type: ignore[arg-type]  # no bus: callbacks only
    placements = Placements(routing)
    prompts = RoutedPrompts(kv_view, placements, routing=routing, clock=clock)
    pool = WorkerPool(None, Subjects(), malformed, listeners=[kv_view, placements],  # type: ignore[arg-type]
                      on_peer_prediction=prompts.peer_routed)
    for index, role in enumerate(roles):
        registration = WorkerRegistration(
            worker_id=f"w{index + 1}", role=role, model="m", engine="sim", block_size=BLOCK,
            compat_hash="h", capacity=WorkerCapacity(kv_blocks=512, max_num_seqs=64, max_model_len=4096),
            started_at=clock.now, heartbeat_at=clock.now)
        pool._members.apply(registration.worker_id, encode(registration))
    state = RoutingState(pool, prompts, routing=routing, policy=build_policy(routing),
                         metrics=RouterMetrics(malformed), clock=clock)
    return state, pool, kv_view


def _prompts(rng: random.Random, count: int) -> Iterator[list[int]]:
    prefixes = [[rng.randrange(1, 30000) for _ in range(rng.choice((16, 48, 96, 200, 1500)))] for _ in range(12)]
    for _ in range(count):
        prefix = prefixes[min(int(rng.expovariate(0.35)), len(prefixes) - 1)]
        tail = rng.randrange(4, 40) if rng.random() < 0.9 else rng.randrange(600, 1200)  # a tenth: long ones
        yield prefix + [rng.randrange(1, 30000) for _ in range(tail)]


def _run(seed: int, requests: int, roles: tuple[WorkerRole, ...], decisions: list[tuple] | None) -> float:
    """One seeded run; its routing's CPU seconds (the harness's own work excluded)."""
    clock, rng = _Clock(), random.Random(seed)
    state, pool, kv_view = _stack(clock, roles)
    flying: deque = deque()
    seqs = {f"w{index + 1}": 0 for index in range(len(roles))}
    cpu = 0.0
    for number, prompt in enumerate(_prompts(rng, requests)):
        clock.now += 0.001
        params = GenerationParams(request_id=f"r{number}", endpoint="completions", model="m", arrived_at=clock.now,
                                  prompt_ids=prompt, sampling=SamplingParams(max_tokens=8), stop=())
        started = time.thread_time()
        decision = state.ask(Attempt(params, INVALID_SPAN, deadline=clock.now))
        committed = state.commit(decision, decision.outcome)  # type: ignore[arg-type]  # always a plan here
        cpu += time.thread_time() - started
        plan = committed.plan
        if decisions is not None:
            decisions.append((plan.worker_id, plan.prefill_worker_id, plan.flow, plan.reason, round(plan.cost, 9),
                              plan.prompt))
        flying.append((committed, prompt))
        if len(flying) > IN_FLIGHT // 4:
            flying[-IN_FLIGHT // 4][0].first.prefill_done()
        if len(flying) >= IN_FLIGHT:  # the oldest ends: its worker reports the prompt's blocks
            done, done_prompt = flying.popleft()
            done.first.end()
            worker_id = done.plan.computing_worker_id
            seqs[worker_id] += 1
            chain = block_hash_chain(done_prompt, BLOCK)
            kv_view.of_worker(worker_id).index.ingest(KvEventBatch(
                worker_id=worker_id, seq=seqs[worker_id], ts=clock.now,
                events=[BlockStored(block_hashes=chain, parent_block_hash=None, block_size=BLOCK, chain_hashes=chain)]))
        if number % 250 == 0:
            for worker_id in seqs:
                pool._on_load(LoadSnapshot(worker_id=worker_id, seq=number + 1, ts=clock.now, running=rng.randrange(8),
                                           waiting=0, kv_total_blocks=512, kv_used_blocks=rng.randrange(200),
                                           kv_cached_blocks=rng.randrange(400), prompt_tokens_total=0,
                                           cached_tokens_total=0, generated_tokens_total=0,
                                           pending_prefill_tokens=rng.randrange(300)))
    return cpu


def decisions(seed: int, requests: int = 300, roles: tuple[WorkerRole, ...] = FLEETS[1]) -> list[tuple]:
    made: list[tuple] = []
    _run(seed, requests, roles, made)
    return made


def digest(seeds: range, requests: int = 300) -> str:
    """One hash of every decision of the seeded runs, on each fleet of `FLEETS`."""
    hashed = hashlib.sha256()
    for roles in FLEETS:
        for seed in seeds:
            hashed.update(repr(decisions(seed, requests, roles)).encode())
    return hashed.hexdigest()


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    for roles in FLEETS:
        runs = [_run(seed, REQUESTS, roles, None) / REQUESTS * 1e6 for seed in range(repeats)]
        fleet = ", ".join(f"{roles.count(role)} {role.value}" for role in dict.fromkeys(roles))
        print(f"route, {fleet}: {statistics.median(runs):.2f} CPU-us per request "
              f"(runs: {', '.join(f'{value:.2f}' for value in runs)})")


if __name__ == "__main__":
    main()
