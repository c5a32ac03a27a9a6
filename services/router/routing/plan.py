"""The answer of routing: a `RoutePlan`, and how it is built from a policy's `Selection`.

Pure and synchronous. A plan names every worker a request needs and how the prompt's KV
moves between them; the router's flow executor (`services.router.flows.executor`) runs any plan:

- "single": one worker serves the whole request. It computes the prompt, after pulling a
  cached prefix from a holder when `prompt.holder_id` names one (a *prefix pull*).
- "disaggregated" (XpYd): a prefill worker computes the prompt (with a prefix pull of its
  own, if planned) and the first token; a decode worker of the *same compatibility hash*
  generates the rest. Its prompt KV reaches the decode worker by `transfer`:
  "pull" (prefill first; the decode worker reads a lease) or "push" (the decode worker
  allocates first; the prefill worker writes each layer into it). A request asking for
  one token has no decode part (`transfer` None): the prefill worker's token is all.

How KV moves (`kv_transfer_mode`): "pull" always works; "push" (`RoutingConfig.pd_transfer`)
only where both engines' data planes implement it (their advertised capabilities), their
block sizes are equal (a push maps KV heads and layers between unlike tensor- and pipeline-
parallel shapes, a pull maps block sizes too), and no
cached prefix is to be pulled onto the prefill worker first (a pushing prefill worker
pulls none; the plan's cost assumed the pull), and the request does not replay its first
token on the decode worker (`RouteRequest.replays`: the token must exist before that part).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from services.router.routing.candidates import Candidates
from services.router.routing.config import RoutingConfig
from services.router.routing.cost import PrefillPlan
from services.router.routing.view import WorkerView

Flow = Literal["single", "disaggregated"]
KvTransferMode = Literal["pull", "push"]
# Why a flow was chosen; metric label values, so a small closed set.
RouteReason = Literal[
    "pair",  # disaggregated: the cheapest flow is a prefill and a decode worker of one compatibility hash
    "small_uncached",  # single on a decode worker: less than `local_prefill_tokens` uncached there
    "prefill_busy",  # single on a decode worker: every prefill worker is busy
    "single_cheaper",  # single on a BOTH worker: cheaper than every pair
    "decode_first",  # single: the request's cache-hit threshold chose the worker
    "baseline",  # single: a benchmark baseline policy (round-robin or random) chose the worker
    "pinned",  # the request's route hint named the worker, or the pair (the pinned policy, for benchmarks)
    "no_prefill_worker",  # single: no ACTIVE prefill worker of the model can take the prompt
    "no_decode_worker",  # single: prefill workers exist, but no ACTIVE decode worker can take the request
    "one_worker",  # single: any worker may prefill for another (`prefill_from` "any"), but it is the only one
    "compat_hash_mismatch",  # single: prefill and decode workers exist, but no KV maps between them (the note says why)
    "one_engine_sampling",  # single: the request needs its whole prompt computed there (`RouteRequest.one_engine`)
]


@dataclass(slots=True, unsafe_hash=True)
class Selection:  # read-only by convention (not frozen: built per request, and a frozen dataclass is slow to build)
    """What a policy picked: one worker, or a (prefill, decode) pair, and why."""

    reason: RouteReason
    worker: WorkerView  # single: serves the whole request; pair: the decode worker
    prefill: WorkerView | None = None  # a pair's prefill worker
    # the computing worker is the prompt's prefix's new home, picked as it leaves its old one
    # (`placement.rules.HomeRules.moves_home`): the plan says so
    moves_home: bool = False
    note: str = ""  # what a person needs besides the reason (why no pair: the field that differs)


@dataclass(slots=True, unsafe_hash=True)
class RoutePlan:  # read-only by convention (not frozen: built per request, and a frozen dataclass is slow to build)
    flow: Flow
    reason: RouteReason
    worker_id: str  # single: serves the whole request; disaggregated: the decode worker
    prefill_worker_id: str | None = None  # disaggregated only
    # How the computing worker gets the prompt's KV (held, pulled from a holder, computed),
    # how a decode part gets it, and what the flow was estimated to cost: for the flow,
    # the span and the predictions, not part of the plan's identity.
    prompt: PrefillPlan | None = field(default=None, compare=False)
    transfer: KvTransferMode | None = field(default=None, compare=False)  # None: no decode part
    cost: float = field(default=0.0, compare=False)
    # the prompt's prefix leaves its home for the computing worker (`placement.rules.HomeRules`):
    # the placement records a move there, not a copy, though the old home may still hold the prompt
    moves_home: bool = field(default=False, compare=False)
    note: str = field(default="", compare=False)  # the selection's

    def __post_init__(self) -> None:
        assert (self.flow == "disaggregated") == (self.prefill_worker_id is not None), self
        assert self.transfer is None or self.flow == "disaggregated", self

    @property
    def computing_worker_id(self) -> str:
        """The worker that computes the prompt."""
        return self.prefill_worker_id or self.worker_id

    @property
    def decode_worker_id(self) -> str | None:
        """The worker of the decode part; None without one."""
        return self.worker_id if self.transfer is not None else None

    @property
    def prefix_holder_id(self) -> str | None:
        """A worker the computing worker pulls a cached prefix of the prompt from."""
        return self.prompt.holder_id if self.prompt is not None else None


def kv_transfer_mode(routing: RoutingConfig, prefill: WorkerView, decode: WorkerView, *,
                     prefix_pull: bool, replays: bool = False) -> KvTransferMode:
    """How a disaggregated pair hands the prompt's KV over (see the module's docstring)."""
    if routing.pd_transfer == "push" and not (prefix_pull or replays) and prefill.kv_push and decode.kv_push \
            and prefill.block_size == decode.block_size:
        return "push"
    return "pull"


def build_plan(selection: Selection, candidates: Candidates) -> RoutePlan:
    """The plan for what the policy selected, costed by the same `candidates`."""
    if selection.prefill is None:
        single = candidates.single(selection.worker)
        return RoutePlan("single", selection.reason, selection.worker.worker_id, prompt=single.plan,
                         cost=single.cost, moves_home=selection.moves_home, note=selection.note)
    pair = candidates.pair(selection.prefill, selection.worker)
    prompt = pair.prefill.plan
    transfer = None
    if candidates.request.max_tokens > 1:
        transfer = kv_transfer_mode(candidates.routing, selection.prefill, selection.worker,
                                    prefix_pull=prompt.holder_id is not None, replays=candidates.request.replays)
    return RoutePlan("disaggregated", selection.reason, selection.worker.worker_id,
                     prefill_worker_id=selection.prefill.worker_id, prompt=prompt, transfer=transfer, cost=pair.cost,
                     moves_home=selection.moves_home)
