"""The router's routing state (`flows.routing_state`): `ask` decides and changes nothing,
`commit` changes every store a decision touches at once (the worker's ledger, the KV
namespace's predictions, the prefix's placement), and a peer router's routed prompt reaches
the KV namespace and the placement through the handler the worker pool was built with."""

from __future__ import annotations

from opentelemetry.trace import INVALID_SPAN

from services.router.config import RoutingConfig
from services.router.fleet.worker_pool import WorkerPool
from services.router.flows.records import GenerationParams
from services.router.flows.routing_state import Attempt, RoutedPrompts, RoutingState
from services.router.kv.view import KvView
from services.router.metrics import RouterMetrics
from services.router.routing import RoutePlan, build_policy
from services.router.routing.placement.placement import Placements
from shared.block_hash import block_hash_chain
from shared.codec import MalformedCounter, encode
from shared.schemas import RoutedPrompt, RouterLoad, SamplingParams, WorkerCapacity, WorkerRegistration
from shared.schemas.membership import WorkerRole
from shared.subjects import Subjects

BLOCK = 16
PROMPT = list(range(1, 4 * BLOCK + 1))  # four full blocks
NOW = 1000.0


def stack() -> tuple[RoutingState, WorkerPool, KvView, Placements]:
    malformed, routing = MalformedCounter(), RoutingConfig()
    kv_view = KvView(None, Subjects(), malformed)  # type: ignore[arg-type]  # no bus: callbacks only
    placements = Placements(routing)
    prompts = RoutedPrompts(kv_view, placements, routing=routing, clock=lambda: NOW)
    pool = WorkerPool(None, Subjects(), malformed, listeners=[kv_view, placements],  # type: ignore[arg-type]
                      on_peer_prediction=prompts.peer_routed)
    for worker_id in ("w1", "w2"):
        registration = WorkerRegistration(
            worker_id=worker_id, role=WorkerRole.BOTH, model="m", engine="sim", block_size=BLOCK, compat_hash="h",
            capacity=WorkerCapacity(kv_blocks=512, max_num_seqs=64, max_model_len=4096),
            started_at=NOW, heartbeat_at=NOW)
        pool._members.apply(worker_id, encode(registration))
    state = RoutingState(pool, prompts, routing=routing, policy=build_policy(routing),
                         metrics=RouterMetrics(malformed), clock=lambda: NOW)
    return state, pool, kv_view, placements


def attempt(request_id: str, excluded: frozenset[str] = frozenset()) -> Attempt:
    params = GenerationParams(request_id=request_id, endpoint="completions", model="m", arrived_at=NOW,
                              prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=8), stop=())
    return Attempt(params, INVALID_SPAN, deadline=NOW, excluded=excluded)


def in_flight(pool: WorkerPool) -> dict[str, int]:
    return {view.worker_id: view.in_flight for view in pool.views()}


def test_ask_changes_nothing_and_commit_changes_every_store_at_once() -> None:
    state, pool, kv_view, placements = stack()
    decision = state.ask(attempt("r1"))
    plan = decision.outcome
    assert isinstance(plan, RoutePlan) and plan.prefill_worker_id is None
    assert in_flight(pool) == {"w1": 0, "w2": 0}
    assert kv_view.model("m").prompt_cache(PROMPT, NOW).cached_tokens.get(plan.worker_id, 0) == 0
    committed = state.commit(decision, plan)
    assert in_flight(pool)[plan.worker_id] == 1  # the ledger
    assert kv_view.model("m").prompt_cache(PROMPT, NOW).cached_tokens[plan.worker_id] == len(PROMPT)  # predicted
    assert placements.model("m").snapshot(decision.cache.prefix_key).home == plan.worker_id  # recorded
    committed.first.end()
    assert in_flight(pool)[plan.worker_id] == 0


def test_an_attempt_avoids_the_workers_it_lost() -> None:
    state, _, _, _ = stack()
    first = state.ask(attempt("r1"))
    assert isinstance(first.outcome, RoutePlan)
    lost = first.outcome.worker_id
    again = state.ask(attempt("r1-r1", excluded=frozenset({lost})))
    assert isinstance(again.outcome, RoutePlan) and again.outcome.worker_id != lost
    assert lost not in {view.worker_id for view in again.views}


def test_a_peer_routers_prompt_is_predicted_and_recorded_here() -> None:
    _, pool, kv_view, placements = stack()
    chain = block_hash_chain(PROMPT, BLOCK)
    prompt = RoutedPrompt(worker_id="w2", chains={BLOCK: chain}, ttl_s=2.0)
    pool.shared_load.receive(encode(RouterLoad(router_id="peer", seq=1, interval_s=0.5, full=False,
                                               predictions=[prompt])), "router.load.peer")
    assert kv_view.model("m").prompt_cache(PROMPT, NOW).cached_tokens == {"w2": len(PROMPT)}
    assert placements.model("m").snapshot(chain[0]).home == "w2"
