"""Cost model: what one candidate flow of a request would cost. Pure and synchronous.

Called through `candidates.Candidates` (the scoring stage every policy and the plan
builder share) with plain data: the workers' views and, per worker, how much of the
prompt's leading blocks the KV index says it holds. Costs are in prompt-token
equivalents, a proxy for time to first token and for work the cluster must do:

    cost = prefill_weight  x tokens the computing worker must compute
         + transfer_weight x tokens it pulls from another worker's cache instead
         + queue_weight    x prompt tokens predicted to be queued for prefill ahead of it
         + decode_weight   x the decode worker's predicted running+waiting / max_num_seqs

The computing worker is the prefill worker of a (prefill, decode) pair, or the one worker
of a single-worker flow (then it is the decode worker too). Work the computing worker
must do counts more than work it waits for (`queue_weight` < `prefill_weight` by
default): a sibling request queued behind the request that computes its prefix costs
the cluster nothing extra, so a burst with one prefix lands together.

A worker can pull a prefix from a holder with the same compatibility hash (hence the same
block size); only blocks the holder *reported* count (`held_tokens`), never blocks it is
merely predicted to compute, which might not exist yet when the pull reads them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from services.router.routing.view import WorkerView
from shared.config import RoutingConfig
from shared.schemas.membership import WorkerStatus


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """How the computing worker would get a prompt's KV: held, pulled, computed (tokens)."""

    worker_id: str
    cached_tokens: int  # leading prompt tokens it holds, or is predicted to hold
    pulled_tokens: int  # further tokens it would pull from `holder_id`
    holder_id: str | None
    uncached_tokens: int  # tokens it computes itself

    def __post_init__(self) -> None:
        assert (self.holder_id is None) == (self.pulled_tokens == 0), self


class Holders:
    """Per compatibility hash, the two ACTIVE workers reporting the longest prefix of a prompt
    (two: a worker never pulls from itself). Built once per request: O(workers)."""

    def __init__(self, workers: Iterable[WorkerView], held_tokens: Mapping[str, int]) -> None:
        self._top: dict[str, list[tuple[int, str]]] = {}
        for worker in workers:
            held = held_tokens.get(worker.worker_id, 0)
            if held <= 0 or worker.status is not WorkerStatus.ACTIVE:
                continue
            top = self._top.setdefault(worker.compat_hash, [])
            top.append((held, worker.worker_id))
            top.sort(key=lambda entry: (-entry[0], entry[1]))
            del top[2:]

    def best_for(self, worker: WorkerView) -> tuple[int, str | None]:
        """The longest prefix (tokens) another worker could lend `worker`, and who holds it."""
        for held, holder_id in self._top.get(worker.compat_hash, ()):
            if holder_id != worker.worker_id:
                return held, holder_id
        return 0, None


def plan_prefill(worker: WorkerView, prompt_tokens: int, cached_tokens: Mapping[str, int],
                 holders: Holders) -> PrefillPlan:
    own = min(cached_tokens.get(worker.worker_id, 0), prompt_tokens)
    held, holder_id = holders.best_for(worker)
    held = min(held, prompt_tokens)
    if held <= own:
        return PrefillPlan(worker.worker_id, own, 0, None, prompt_tokens - own)
    return PrefillPlan(worker.worker_id, own, held - own, holder_id, prompt_tokens - held)


def prefill_cost(routing: RoutingConfig, plan: PrefillPlan, computing: WorkerView) -> float:
    """The computing worker's part of a flow's cost."""
    return (routing.prefill_weight * plan.uncached_tokens + routing.transfer_weight * plan.pulled_tokens
            + routing.queue_weight * computing.predicted_prefill_tokens)


def decode_cost(routing: RoutingConfig, decode: WorkerView) -> float:
    """The decode worker's part of a flow's cost."""
    return routing.decode_weight * decode.relative_load
