"""Cost model: what one candidate flow of a request would cost. Pure and synchronous.

Called through `candidates.Candidates` (the scoring stage every policy and the plan
builder share) with plain data: the workers' views and, per worker, how much of the
prompt's leading blocks the KV index says it holds. Costs are in prompt-token
equivalents (the time one worker takes to compute one prompt token), a proxy for time to
first token and for work the cluster must do:

    cost = prefill_weight  x tokens the computing worker must compute
         + load cost       (host_load_weight x its cached tokens in its host-memory KV tier)
         + pull cost       (pull_fixed_tokens + transfer_weight x tokens pulled, when it pulls)
         + eviction cost   (eviction_weight x cached tokens the new KV pushes out of its cache)
         + queue_weight    x prompt tokens predicted to be queued for prefill ahead of it
         + itl_weight      x its requests that decode there x the tokens it computes
         + hand-off cost   (pull_fixed_tokens + transfer_weight x prompt tokens, for a pair,
                            where any worker may prefill: `handoff_cost`)
         + decode_weight   x the decode worker's predicted running+waiting / max_num_seqs
         + itl_weight      x prompt tokens predicted to be queued on the decode worker
                            (a pair's only: a whole request's prompt is computed after them)
         + exposure        (on the worker the next prompts go to: `decode_exposure`)

The computing worker is the prefill worker of a (prefill, decode) pair, or the one worker
of a single-worker flow (then it is the decode worker too).

*Interference* (`itl_weight`, 0 by default): a prompt computed on a worker delays every
request decoding there (chunked prefill shares their steps: their inter-token latency
spikes by the prompt's compute), and a request decoding on a worker waits for the prompts
queued there. Only requests that decode on the worker count (`WorkerView.decoding_load`): a
pair's prefill part there, a prompt computed for another worker, has no decode to stall.
And only a pair's decode waits for its decode worker's queue: a request served whole has
its prompt computed after the prompts queued ahead of it, which delay its first token (the
queue term) and none of its decode steps. Priced, they make the router disaggregate where
it wins: with any worker allowed to prefill for any other (`prefill_from` "any"), a prompt
goes to a worker with few requests decoding and its decode stays where it is or moves to
one with little prefill queued; when nothing decodes anywhere (arrivals spread out) serving
whole is cheapest, as it saves the transfer. docs/routing.md derives the weights.

What the terms buy, together:
- *Affinity with bounded imbalance.* A worker holding the prompt's prefix costs its queue
  plus the rest of the prompt; any other worker also pays the pull (or the compute) of the
  prefix and the prefix's worth of evictions once its cache is full. So the holder keeps
  the prefix's requests until its queue exceeds the others' by what the hit is worth
  (`affinity_margin`): a long prefix tolerates a long queue, a short one hardly any.
- *Eviction.* New KV on a full cache pushes out other prefixes, which someone must
  compute again later; spreading a tenant over every worker churns every cache. Free KV
  comes from the load snapshots, less what this router sent since.
- *Cold victims first.* On full caches the eviction cost is weighted by how recently the
  worker's least recently used prefix was asked for (`recency`): new KV goes where the
  coldest prefix is, so the cluster evicts as one LRU cache would.
- *Replication of a hot prefix.* When every worker holding (or about to hold) the longest
  cached prefix carries more than `hot_load_factor` x the serving workers' mean load (and
  at least `placement.shares.HOT_MIN_EXCESS` requests more, or a prompt's worth more queued prefill), its
  holders cannot carry the prefix's traffic (a popular tenant's): bounded affinity lets
  go (`policies.cheapest.Cheapest.affine`), and the plain costs pick the copy's worker, one
  with room or a cold victim first: a copy never comes free where it evicts a prefix in
  use (a burst of one tenant's requests must not push another active tenant out).
  A queue is a moment's figure, and a copy evicts another tenant for good: so a prefix is
  copied only while its own share of the recent requests is more than its holders can
  carry, each at most `(1 + replica_share_slack) / serving workers` of it
  (`placement.shares.copies_needed`). A tenant whose share one worker can carry queues there rather than
  spread; an overcommitted worker sheds its minor tenants when their prompts are computed
  anyway (`placement.home`), not by copying them.

*Tiers.* A cached token a worker keeps in a slower KV tier (`tier_load_cost`: host memory,
loaded back at `host_load_weight`, the measured ratio of a load to a prefill per token;
disk, which no engine reports yet, at the full prefill weight) counts less than one in its
first tier and more than a miss; loaded, those tokens take room in the first tier like
computed ones (`PrefillPlan.loaded_tokens`, in the eviction cost). With `kv_tier_aware` off the router is tier-blind: such
tokens never reach the cost model (`kv.model_kv.tiered_prefix` ends the prefix there).

A worker can pull a prefix from a holder with the same compatibility hash (hence the same
block size); only blocks the holder *reported* count (`held_tokens`), never blocks it is
merely predicted to compute, which might not exist yet when the pull reads them. With
`prefix_pull` off (a plain baseline) nobody pulls.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from services.router.routing.config import RoutingConfig
from services.router.routing.view import WorkerView
from shared.schemas.membership import WorkerStatus


@dataclass(slots=True, unsafe_hash=True)
class PrefillPlan:  # read-only by convention (not frozen: built per request, and a frozen dataclass is slow to build)
    """How the computing worker would get a prompt's KV: held, pulled, computed (tokens)."""

    worker_id: str
    cached_tokens: int  # leading prompt tokens it holds, or is predicted to hold
    pulled_tokens: int  # further tokens it would pull from `holder_id`
    holder_id: str | None
    uncached_tokens: int  # tokens it computes itself
    load_cost: float = 0.0  # loading its cached tokens that sit outside its first KV tier
    loaded_tokens: int = 0  # ... those tokens: loaded, they take room in its first tier like computed ones

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
                 holders: Holders, tier_tokens: Mapping[str, int] | None = None,
                 routing: RoutingConfig | None = None) -> PrefillPlan:
    """`tier_tokens`: the worker's own cached tokens outside its first tier, per tier, whose
    load `routing` prices (`tier_load_cost`)."""
    own = min(cached_tokens.get(worker.worker_id, 0), prompt_tokens)
    held, holder_id = holders.best_for(worker)
    held = min(held, prompt_tokens)
    load_cost = tier_load_cost(routing, tier_tokens) if routing is not None else 0.0
    loaded = min(own, sum(tier_tokens.values())) if tier_tokens else 0
    if held <= own:
        return PrefillPlan(worker.worker_id, own, 0, None, prompt_tokens - own, load_cost, loaded)
    return PrefillPlan(worker.worker_id, own, held - own, holder_id, prompt_tokens - held, load_cost, loaded)


def tier_load_cost(routing: RoutingConfig, tier_tokens: Mapping[str, int] | None) -> float:
    """Loading cached tokens kept outside a worker's first KV tier (tokens per tier): a
    host-memory token at `host_load_weight`, any slower tier's as much as computing it."""
    if not tier_tokens:
        return 0.0
    return sum(tokens * (routing.host_load_weight if tier == "host" else routing.prefill_weight)
               for tier, tokens in tier_tokens.items())


def handoff_cost(routing: RoutingConfig, prompt_tokens: int) -> float:
    """A disaggregated request's hand-off: its decode worker pulls the prompt's KV (a pull's
    fixed cost and its transfer), what a pair pays that serving whole does not. Priced where
    the router chooses whether to disaggregate (`prefill_from` "any"); with a dedicated
    prefill pool the operator chose it, and pairs are costed as they always were."""
    return pull_cost(routing, prompt_tokens) if routing.prefill_from == "any" else 0.0


def decode_exposure(routing: RoutingConfig, prompt_tokens: int, requests_in_flight: int) -> float:
    """What decoding on the worker that the next prompts will be computed on costs (where any
    worker may prefill for any other: the worker with the fewest requests, which the
    interference term sends prompts to): each prompt computed there while the request
    decodes stalls it. Arrivals come in bunches, so as many prompts as there are requests
    in flight are expected meanwhile: `itl_weight` x prompt tokens x requests in flight.
    Priced, a fleet under load keeps one worker free of decodes for the prompts (a pair
    sends the decode elsewhere) and a quiet one serves whole (nothing in flight). Only what
    exceeds the decode's budget counts (`itl_excess`)."""
    return routing.itl_weight * itl_excess(routing, 0, prompt_tokens * requests_in_flight)


def itl_excess(routing: RoutingConfig, shared_tokens: int, added_tokens: int) -> float:
    """Of `added_tokens` more prompt tokens computed beside a decoding request that already
    shares its steps with `shared_tokens` (those queued where it decodes), the ones beyond its
    budget (`itl_budget_tokens`: what it absorbs before its time per output token reaches the
    ITL SLO, `calibration.slo_itl_budget_tokens`). Within the budget a stall costs the SLO
    nothing, so serving whole keeps its saved hand-off; with budget 0, every token counts."""
    budget = routing.itl_budget_tokens
    if not budget:
        return added_tokens
    return max(0.0, shared_tokens + added_tokens - budget) - max(0.0, shared_tokens - budget)


def pull_cost(routing: RoutingConfig, pulled_tokens: int) -> float:
    """A prefix pull: a fixed hand-off cost plus the transfer, per token."""
    return routing.pull_fixed_tokens + routing.transfer_weight * pulled_tokens if pulled_tokens else 0.0


def eviction_cost(routing: RoutingConfig, new_tokens: int, free_tokens: int | None, victim_value: float = 1.0) -> float:
    """Cached tokens that `new_tokens` of new KV would push out, weighted: none while the
    cache has free room (`free_tokens`; None: unknown, counted as room). `victim_value` (in
    [0, 1], see `recency`) scales it down where what would be evicted is cold."""
    if free_tokens is None:
        return 0.0
    return routing.eviction_weight * victim_value * max(0, new_tokens - free_tokens)


def prefill_cost(routing: RoutingConfig, plan: PrefillPlan, computing: WorkerView, *,
                 victim_value: float = 1.0) -> float:
    """The computing worker's part of a flow's cost; `victim_value`: the weight of what its
    full cache would evict (`recency.victim_values`)."""
    new_tokens = plan.pulled_tokens + plan.uncached_tokens + plan.loaded_tokens
    return (routing.prefill_weight * plan.uncached_tokens + plan.load_cost + pull_cost(routing, plan.pulled_tokens)
            + eviction_cost(routing, new_tokens, computing.free_kv_tokens, victim_value)
            + routing.queue_weight * computing.predicted_prefill_tokens
            + interference(routing, computing, plan.uncached_tokens))


def interference(routing: RoutingConfig, computing: WorkerView, uncached_tokens: int) -> float:
    """What computing `uncached_tokens` on `computing` costs the requests decoding there: each
    of them waits for the prompt's compute (chunked prefill shares their steps), so their
    inter-token latency spikes: `itl_weight` x requests that decode there (not the prompts
    it computes for other workers) x tokens (those beyond their budget, after the prompts
    queued there: `itl_excess`)."""
    if not routing.itl_weight or not computing.decoding_load:
        return 0.0
    excess = itl_excess(routing, computing.predicted_prefill_tokens, uncached_tokens)
    return routing.itl_weight * computing.decoding_load * excess


def affinity_margin(routing: RoutingConfig, cached_tokens: int, free_tokens: int | None = 0) -> float:
    """How many more queued prompt tokens (x queue_weight) a holder of `cached_tokens` of the
    prompt may have than an idle non-holder before the non-holder, computing those tokens
    itself, becomes cheaper: the bound on the imbalance affinity accepts."""
    return routing.prefill_weight * cached_tokens + eviction_cost(routing, cached_tokens, free_tokens)


def decode_cost(routing: RoutingConfig, decode: WorkerView, *, whole: bool = False) -> float:
    """The decode worker's part of a flow's cost: its batch, and for a pair's decode worker
    the prompt tokens queued there, which the request's decode steps will wait for
    (`itl_weight` per token beyond its budget, `itl_excess`). `whole`: the request is served
    whole there, its own prompt computed after those, so they delay only its first token
    (priced by the queue term) and its decode waits for none."""
    if whole or not routing.itl_weight:
        return routing.decode_weight * decode.relative_load
    waits = itl_excess(routing, 0, decode.predicted_prefill_tokens)
    return routing.decode_weight * decode.relative_load + routing.itl_weight * waits
