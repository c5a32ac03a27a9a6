"""Adapter residency: a worker's adapter slots (`services.worker.adapter_slots`) and the
router's adapter-aware routing (`services.router.routing.adapters`, applied by eligibility):
a request naming an adapter goes to a worker holding it, else one with a free slot, else one
that must evict; never to a worker without slots; a request for the base model is routed as
before."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from functools import partial

from services.orchestrator.command_checks import refusal
from services.orchestrator.config import WorkerLimits
from services.router.config import RoutingConfig
from services.router.fleet.worker_pool import WorkerPool
from services.router.routing import RoutePlan, RouteRefusal, RouteRequest, WorkerView, decide
from services.router.routing.adapters import Residency, preferred, residency
from services.worker.adapter_slots import AdapterSlots, AdapterUse, apply_adapter_message
from shared.codec import MalformedCounter, encode
from shared.errors import InvalidArgument
from shared.schemas import (
    EngineCapabilities,
    LoadAdapter,
    UnloadAdapter,
    WorkerCapacity,
    WorkerRegistration,
    WorkerRole,
)
from shared.schemas import orchestrator as commands
from shared.subjects import Subjects
from tests.unit.worker_views import worker_view

REQUEST = RouteRequest(model="m", prompt_tokens=500, total_tokens=600)
worker = partial(worker_view, adapter_slots=2)


def routed(workers: list[WorkerView], adapter: str, **fields) -> RoutePlan | RouteRefusal | None:
    return decide(workers, replace(REQUEST, adapter=adapter, **fields), RoutingConfig())


def test_slots_load_on_use_and_evict_the_least_recently_used() -> None:
    slots = AdapterSlots(2, ("alpha",))
    assert slots.use("alpha") == AdapterUse(held=True)
    assert slots.use("beta") == AdapterUse(held=False)
    assert slots.use("alpha") == AdapterUse(held=True)  # beta is now the least recently used
    assert slots.use("gamma") == AdapterUse(held=False, evicted="beta")
    assert slots.held == ["alpha", "gamma"]
    assert slots.unload("alpha") and not slots.unload("alpha")
    assert slots.held == ["gamma"]


def test_a_worker_without_slots_serves_no_adapter() -> None:
    assert AdapterSlots(0).use("alpha") is None
    assert residency(worker_view("w"), "alpha") is None
    assert routed([worker_view("w")], "alpha") is None  # nobody can serve it: the caller waits
    assert routed([worker_view("w")], "").worker_id == "w"


def test_residency_orders_held_then_free_slot_then_eviction() -> None:
    assert residency(worker("h", adapters=frozenset({"alpha"})), "alpha") is Residency.HELD
    assert residency(worker("f", adapters=frozenset({"beta"})), "alpha") is Residency.FREE_SLOT
    assert residency(worker("e", adapters=frozenset({"beta", "gamma"})), "alpha") is Residency.EVICTS
    workers = [worker("e", adapters=frozenset({"beta", "gamma"})), worker("f"), worker("h", adapters=frozenset({"alpha"}))]
    assert [view.worker_id for view in preferred(workers, "alpha")] == ["h"]
    assert [view.worker_id for view in preferred(workers[:2], "alpha")] == ["f"]
    assert [view.worker_id for view in preferred(workers[:1], "alpha")] == ["e"]
    assert preferred(workers, "") == workers


def test_an_adapters_requests_go_to_its_holder_even_when_it_is_busier() -> None:
    holder = worker("holder", adapters=frozenset({"alpha"}), reported_load=6)
    idle = worker("idle")
    assert routed([idle, holder], "alpha").worker_id == "holder"
    assert routed([idle, holder], "").worker_id == "idle"  # the base model: load decides


def test_a_full_holder_leaves_its_adapter_to_a_free_slot() -> None:
    full = worker("holder", adapters=frozenset({"alpha"}), reported_load=8 * 4)  # past the queue limit
    evicting = worker("evicting", adapters=frozenset({"beta", "gamma"}))
    free = worker("free", adapters=frozenset({"beta"}))
    assert routed([full, evicting, free], "alpha").worker_id == "free"
    assert routed([full, evicting], "alpha").worker_id == "evicting"


def test_both_sides_of_a_pair_prefer_the_adapters_holders() -> None:
    prefills = [worker(f"p{i}", role=WorkerRole.PREFILL, adapters=frozenset({"alpha"} if i == 2 else set()))
                for i in range(3)]
    decodes = [worker(f"d{i}", role=WorkerRole.DECODE, adapters=frozenset({"alpha"} if i == 1 else set()))
               for i in range(3)]
    plan = routed([*prefills, *decodes], "alpha")
    assert isinstance(plan, RoutePlan) and plan.flow == "disaggregated"
    assert (plan.prefill_worker_id, plan.worker_id) == ("p2", "d1")


def test_loading_an_adapter_needs_a_worker_with_adapter_slots() -> None:
    def registration(worker_id: str, slots: int) -> WorkerRegistration:
        return WorkerRegistration(worker_id=worker_id, role=WorkerRole.BOTH, model="tiny", engine="sim", block_size=16,
                                  compat_hash="c", capacity=WorkerCapacity(kv_blocks=64, max_num_seqs=8, max_model_len=2048),
                                  started_at=0.0, heartbeat_at=0.0, adapter_slots=slots)

    members = {"w1": registration("w1", 0), "w2": registration("w2", 2)}
    limits = WorkerLimits()

    def why(command: commands.OrchestratorCommand) -> str | None:
        return refusal(command, members, limits, can_launch=False)

    assert "serves no LoRA adapters" in why(commands.LoadWorkerAdapter(worker_id="w1", adapter="alpha"))
    assert why(commands.LoadWorkerAdapter(worker_id="w2", adapter="alpha")) is None
    assert why(commands.UnloadWorkerAdapter(worker_id="w1", adapter="alpha")) is None
    assert "no registered worker" in why(commands.LoadWorkerAdapter(worker_id="w9", adapter="alpha"))


def test_the_pool_sees_held_adapters_and_whether_adapter_kv_can_move() -> None:
    pool = WorkerPool(None, Subjects(), MalformedCounter())  # type: ignore[arg-type]  # no bus: callbacks only

    def register(worker_id: str, adapter_kv: bool) -> None:
        registration = WorkerRegistration(
            worker_id=worker_id, role=WorkerRole.BOTH, model="m", engine="fake", block_size=16, compat_hash="h",
            capacity=WorkerCapacity(kv_blocks=64, max_num_seqs=8, max_model_len=1024), started_at=0.0,
            heartbeat_at=0.0, adapters=["alpha"], adapter_slots=2,
            capabilities=EngineCapabilities(adapter_kv_transfer=adapter_kv))
        pool._members.apply(worker_id, encode(registration))

    register("w1", True)
    [view] = pool.views(["w1"])
    assert (view.adapters, view.adapter_slots) == (frozenset({"alpha"}), 2)
    assert pool.moves_adapter_kv("m")
    register("w2", False)  # one worker that cannot: the model's adapter requests stay whole
    assert not pool.moves_adapter_kv("m")


class AdapterEngine:
    """What `apply_adapter_message` asks of an engine: to load an adapter, which it may refuse."""

    def __init__(self, servable: set[str]) -> None:
        self.servable = servable

    async def load_adapter(self, adapter: str) -> None:
        if adapter not in self.servable:
            raise InvalidArgument(f"no LoRA adapter {adapter!r}")


def test_control_messages_load_and_unload_through_the_engine() -> None:
    slots, engine = AdapterSlots(1), AdapterEngine({"alpha", "beta"})

    def apply(message) -> tuple[str, str]:
        return asyncio.run(apply_adapter_message(message, slots, engine))  # type: ignore[arg-type]

    assert apply(LoadAdapter(adapter="alpha")) == ("applied", "alpha loaded")
    assert apply(LoadAdapter(adapter="alpha"))[0] == "unchanged"
    assert apply(LoadAdapter(adapter="beta")) == ("applied", "beta loaded in place of alpha")
    assert apply(LoadAdapter(adapter="missing")) == ("refused", "no LoRA adapter 'missing'")
    assert slots.held == ["beta"]
    assert apply(UnloadAdapter(adapter="beta")) == ("applied", "beta unloaded")
    assert apply(UnloadAdapter(adapter="beta"))[0] == "unchanged"
    no_slots = asyncio.run(apply_adapter_message(LoadAdapter(adapter="alpha"), AdapterSlots(0), engine))  # type: ignore[arg-type]
    assert no_slots[0] == "refused"
