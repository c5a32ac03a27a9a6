"""A bench-only routing oracle (pure): affinity under a load cap, knowing what a router cannot.

It knows every group's prefix size and share of the requests (a tenant, a conversation) and
each worker's KV capacity. `assign` places groups on workers: largest share first, each onto
the worker with the most spare load that still has cache room for its prefix (the prefix
then stays cached there); a group whose share exceeds the per-worker load cap is replicated
onto ceil(share / cap) workers, its share split evenly. A group that fits nowhere misses
wherever it goes: its requests weigh `miss_cost` times a cached one's, and it goes to the
worker with the most spare load, so the misses spread instead of piling onto one worker.

With `learn_requests` (the `oracle-learned` arm), the oracle does not know the shares up
front: it places each group on first sight onto the worker with the fewest groups (share-blind,
as a router that has seen nothing would), counts the requests, and once it has counted
`learn_requests` of them places every group again as above with the shares it counted (the
prefix sizes, miss costs and cache sizes it still knows). It shows what a policy that must
learn the popularity can reach in a run of this length: where it falls far behind the
oracle, the oracle's edge is its foreknowledge.

Per request, `Oracle.pick` takes the group's worker with the fewest outstanding requests
(the bench client counts its own: it is the only client); a unique prompt, or a group with no
placement, goes to the least-outstanding worker. Groups first seen at run time (conversations)
are placed on first sight against the groups live then, and `release`d when they end.
Callers: `bench.routing.arms` (the oracle arm, which pins each request to the worker picked
here with the router's `pinned` policy).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

DEFAULT_LOAD_SLACK = 0.2  # a worker may carry (1 + slack) / workers of the requests in groups


@dataclass(frozen=True, slots=True)
class GroupSpec:
    prefix_tokens: int  # KV the group keeps cached on each worker that serves it
    share: float  # the group's share of all requests
    miss_cost: float = 1.0  # the load of one of its requests without its prefix cached, over a cached one's


@dataclass(slots=True)
class WorkerPlan:
    load: float = 0.0  # summed shares placed here
    cache_tokens: int = 0  # summed prefixes placed here
    groups: dict[str, float] = field(default_factory=dict)  # group -> the load it adds here


def load_cap(workers: int, slack: float = DEFAULT_LOAD_SLACK) -> float:
    return (1.0 + slack) / workers


def replicas_for(share: float, cap: float, workers: int) -> int:
    return min(workers, max(1, math.ceil(share / cap - 1e-9)))


def place(name: str, spec: GroupSpec, plans: dict[str, WorkerPlan], capacity_tokens: int, cap: float) -> list[str]:
    """Place one group onto `plans` (updated) and return its workers, primary first."""
    workers = list(plans)
    chosen: list[str] = []
    copies = replicas_for(spec.share, cap, len(workers))
    part = spec.share / copies
    for _ in range(copies):
        free = [worker for worker in workers if worker not in chosen]
        under_cap = [worker for worker in free if plans[worker].load + part <= cap + 1e-9] or free
        roomy = [worker for worker in under_cap if plans[worker].cache_tokens + spec.prefix_tokens <= capacity_tokens]
        # the most spare load (ties to the first worker): among those with room, else among all
        best = max(roomy or free, key=lambda worker: (cap - plans[worker].load, -workers.index(worker)))
        plan = plans[best]
        plan.groups[name] = part if roomy else part * spec.miss_cost
        plan.load += plan.groups[name]
        plan.cache_tokens += spec.prefix_tokens
        chosen.append(best)
    return chosen


def assign(groups: Mapping[str, GroupSpec], workers: Sequence[str], capacity_tokens: int,
           cap: float) -> tuple[dict[str, list[str]], dict[str, WorkerPlan]]:
    """Every group's workers (primary first) and each worker's resulting plan."""
    plans = {worker: WorkerPlan() for worker in workers}
    order = sorted(groups, key=lambda name: (-groups[name].share, name))
    return {name: place(name, groups[name], plans, capacity_tokens, cap) for name in order}, plans


class Oracle:
    def __init__(self, workers: Sequence[str], capacity_tokens: int, groups: Mapping[str, GroupSpec], *,
                 dynamic_spec: GroupSpec | None = None, slack: float = DEFAULT_LOAD_SLACK,
                 learn_requests: int = 0) -> None:
        if not workers:
            raise ValueError("the oracle needs at least one worker")
        if learn_requests < 0:
            raise ValueError("learn_requests must not be negative")
        if learn_requests and groups and dynamic_spec is not None:
            raise ValueError("an oracle learns the shares of the groups known up front: give no dynamic_spec too")
        self.workers = list(workers)
        self.capacity_tokens = capacity_tokens
        self.cap = load_cap(len(self.workers), slack)
        self.dynamic_spec = dynamic_spec  # the spec of a group first seen at run time
        self._dynamic: set[str] = set()
        self._groups = dict(groups)
        self._learning = learn_requests > 0 and bool(groups)
        self._learn_requests = learn_requests
        self.counted: Counter[str] = Counter()  # requests per known group while learning
        if self._learning:
            self.placement: dict[str, list[str]] = {}
            self.plans = {worker: WorkerPlan() for worker in self.workers}
        else:
            self.placement, self.plans = assign(groups, self.workers, capacity_tokens, self.cap)

    @property
    def learning(self) -> bool:
        return self._learning

    def _count(self, group: str) -> None:
        """One more request of a known group while learning; at `learn_requests`, place every
        known group again with the counted shares."""
        self.counted[group] += 1
        if self.counted.total() < self._learn_requests:
            if group not in self.placement:  # share-blind: the worker with the fewest groups
                fewest = min(self.workers, key=lambda worker: len(self.plans[worker].groups))
                self.plans[fewest].groups[group] = 0.0
                self.placement[group] = [fewest]
            return
        total = self.counted.total()
        learned = {name: dataclasses.replace(spec, share=self.counted[name] / total)
                   for name, spec in self._groups.items()}
        self.placement, self.plans = assign(learned, self.workers, self.capacity_tokens, self.cap)
        self._learning = False

    def workers_of(self, group: str | None) -> list[str]:
        """The workers that serve `group` (placing a new one); empty for a unique prompt."""
        if group is None:
            return []
        if self._learning and group in self._groups:
            self._count(group)
        if group not in self.placement:
            if self.dynamic_spec is None:
                return []
            self.placement[group] = place(group, self.dynamic_spec, self.plans, self.capacity_tokens, self.cap)
            self._dynamic.add(group)
        return self.placement[group]

    def pick(self, group: str | None, outstanding: Mapping[str, int]) -> str:
        """The worker for the next request of `group`, given each worker's outstanding requests."""
        candidates = self.workers_of(group) or self.workers
        return min(candidates, key=lambda worker: (outstanding.get(worker, 0), candidates.index(worker)))

    def release(self, group: str) -> None:
        """A run-time group ended: its load and cache room return to its workers."""
        if group not in self._dynamic or self.dynamic_spec is None:
            return
        self._dynamic.discard(group)
        spec = self.dynamic_spec
        copies = self.placement.pop(group)
        for worker in copies:
            plan = self.plans[worker]
            plan.load -= plan.groups.pop(group)
            plan.cache_tokens -= spec.prefix_tokens
