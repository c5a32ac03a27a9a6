"""How the router picks a request's workers: `RoutingConfig`, the config of the routing
library (this package), with `KvAwareConfig`, the kv-aware policy's own knobs; and the
configs of the library's admission queue (`AdmissionConfig`) and cold starts
(`ScaleFromZeroConfig`).

The routing library (this package and the KV index, `services.router.kv.index`) imports
nothing of the router service: its config lives here, beside the code that reads it, and
`services.router.config.RouterConfig` nests them. Each field that is a flag declares it
(`shared.config_fields`): adding a knob is adding a field; a knob only one policy reads
goes in that policy's config. Costs are in prompt-token equivalents.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from shared.config import require
from shared.config_fields import flag
from shared.scalable_models import ScalableModel, scalable_models


class KvAwareConfig(msgspec.Struct, kw_only=True, frozen=True):
    """The kv-aware policy's own knobs (`policies.kv_aware`): when a decode worker serves a
    request whole rather than take a prefill worker's KV. The cost model's weights, which every
    policy's candidates are priced with, are `RoutingConfig`'s."""

    local_prefill_tokens: Annotated[int, flag(
        "A decode worker computes a prompt itself when fewer tokens than this are uncached there (0: always "
        "disaggregate when a prefill/decode pair exists).", env="TANDEM_LOCAL_PREFILL_TOKENS")] = 256
    prefill_busy_tokens: int = 8192  # a prefill worker with this many prompt tokens queued is busy

    def validate(self) -> None:
        require(self.local_prefill_tokens >= 0, "local_prefill_tokens must not be negative")
        require(self.prefill_busy_tokens > 0, "prefill_busy_tokens must be positive")


# Every request that has a prefill/decode pair is split, however short its prompt (the
# router's `--local-prefill-tokens 0`; tests and benchmarks of the hand-off)
ALWAYS_SPLIT = KvAwareConfig(local_prefill_tokens=0)


def _none_if_negative(slack: float) -> float | None:
    return slack if slack >= 0 else None


class RoutingConfig(msgspec.Struct, kw_only=True, frozen=True):
    """How the router picks a request's workers (`services.router.routing`): the policy, the
    cost model's weights, admission. Costs are in prompt-token equivalents."""

    # A name in the router's policy registry (`services.router.routing.registry`), checked
    # when the router starts: a baseline replaces only the choice of worker (pulls and
    # admission still apply)
    policy: Annotated[str, flag(
        "A registered routing policy: kv-aware (cost model), or one for benchmarks (round-robin, random, pinned).",
        name="--routing-policy", doc="pinned: the worker the `X-Tandem-Worker` header names.")] = "kv-aware"
    seed: Annotated[int, flag("Seed of the random policy.", name="--routing-seed")] = 0
    # each policy's own knobs (the baselines have none but the seed above)
    kv_aware: KvAwareConfig = KvAwareConfig()
    # Cost model weights (`services.router.routing.cost`), calibratable from an engine's timing
    # profile and measured transfer bandwidth (`services.router.routing.calibration`)
    prefill_weight: float = 1.0  # per prompt token the computing worker must compute
    transfer_weight: Annotated[float, flag(
        "Cost model: per prompt token pulled from another worker's cache, in prompt-token equivalents "
        "(`tandem bench calibrate` style figures: transfer time / prefill time per token).")] = 0.1
    # the lease round trip and hand-off, in token equivalents
    pull_fixed_tokens: Annotated[float, flag("Cost model: the fixed cost of one prefix pull.")] = 32.0
    eviction_weight: Annotated[float, flag(
        "Cost model: per cached token that a request's new KV would push out of a full cache.")] = 0.5
    queue_weight: Annotated[float, flag("Cost model: per prompt token queued for prefill ahead of the request.")] = 0.5
    decode_weight: Annotated[float, flag(
        "Cost model: for a worker whose batch is full (running+waiting = max_num_seqs).")] = 1024.0
    # where transient prefixes are homed, a miss of 1088 tokens then weighs about 6 hits of 64
    request_overhead_tokens: Annotated[float, flag(
        "Cost model: a request's work beyond the prompt tokens it computes (its engine steps' fixed cost), in "
        "prompt tokens; transient prefixes are homed to balance each worker's work.")] = 128.0
    # a hot prefix is replicated: a non-holder pulling it pays no eviction cost
    hot_load_factor: Annotated[float, flag(
        "Replicate a prefix onto another worker once each of its holders carries more than this x the mean load "
        "of the serving workers (0: never).")] = 1.5
    replica_share_slack: Annotated[float | None, flag(
        "... and only while the prefix's share of recent requests is more than its holders can carry, each "
        "(1 + this) / serving workers of the traffic (negative: the load alone decides).",
        option_type=float, parse=_none_if_negative)] = 0.2
    # off, a queue can push a tenant off its holders
    bounded_affinity: Annotated[bool, flag(
        "A tenant holding most of its prompt on some workers stays on them until its prefix is hot (off: the "
        "per-request cost alone decides).")] = True
    # Off by default: with one active tenant per worker, its last use is Poisson noise, and the
    # weighting then lets a burst evict a tenant that is merely between requests
    cold_victims: Annotated[bool, flag(
        "On full caches, weigh the eviction cost by how recently each worker's least recently used prefix was "
        "routed (off, the default: every full cache weighs the same).")] = False
    # `routing.cost.tier_load_cost`: the measured ratio for the engine (`routing.calibration`);
    # the default is the sim's default profile's (`services/worker/sim/profile.py`)
    host_load_weight: Annotated[float, flag(
        "Cost model: per cached prompt token a worker holds in its host-memory KV tier (loaded back on a hit): "
        "load time / prefill time per token (`routing/calibration.py`).")] = 0.2
    kv_tier_aware: Annotated[bool, flag(
        "Credit a cached block by its KV tier: a block in a worker's host-memory tier costs its load "
        "(--host-load-weight), one on disk as much as computing it (off: a block outside the first tier counts "
        "as not cached, as with a one-tier index).")] = True
    prefix_pull: Annotated[bool, flag(
        "Let a worker pull a cached prompt prefix from another worker instead of computing it (off: a plain "
        "baseline for benchmarks).")] = True
    home_slack_tokens: Annotated[float, flag(
        "A prompt no worker holds half of goes to its prefix's home worker; a new home costs at most this much "
        "more than the cheapest (0: homes off).")] = 256.0
    sticky_homes: Annotated[bool, flag(
        "A prefix's home is the worker that served it last, unless busy; new homes balance the recent traffic "
        "homed on each worker (off: rendezvous hashing only).")] = True
    # `routing.placement.homes`: the resident prefixes claim KV; the recurring others (transient: they miss
    # wherever they go) are homed so that each worker's recent work is balanced, a miss weighing
    # several hits
    resident_homes: Annotated[bool, flag(
        "Where prefixes need more KV than the cluster holds, only the most requested ones that fit claim KV on "
        "their homes: new homes go where their prompts fit, and a worker whose resident prefixes overflow its "
        "KV sheds a minor one (off: every recently used prefix claims KV).")] = True
    # `routing.shortlist`
    shortlist_workers: Annotated[int, flag(
        "Past this many workers, cost a request only against its prefix's holders, its home and workers drawn "
        "at random, up to this many (0: every worker).")] = 16
    cache_hit_threshold: Annotated[float, flag(
        "Decode-first default for requests that name none: serve only from a worker already holding this share "
        "of the prompt's KV, else answer finish_reason 'cache_threshold'. 0: off.",
        env="TANDEM_CACHE_HIT_THRESHOLD")] = 0.0
    max_queue_factor: Annotated[float, flag(
        "Admission control: answer 429 once every worker has running+waiting >= max_num_seqs x this. "
        "0: off.")] = 4.0
    retry_after_s: int = 1  # the Retry-After of a 429
    speculative_ttl_s: float = 5.0  # how long a routed prompt counts as cached on its worker without events
    # `services.router.routing.eligibility`: who computes a prompt for another worker
    prefill_from: Annotated[Literal["prefill", "any"], flag(
        "Who may compute a prompt for another worker: prefill workers only, or any worker (role both too): the "
        "router then disaggregates a request only where the cost model says it wins.")] = "prefill"
    # `services.router.routing.cost.interference`
    itl_weight: Annotated[float, flag(
        "Cost model: per prompt token computed on a worker, per request decoding there (the decode steps it "
        "delays), and per prompt token queued on the decode worker (the prefill its decode will wait for); "
        "0: TTFT alone decides where a prompt is computed.")] = 0.0
    # `services.router.routing.cost.itl_excess`; `calibration.slo_itl_budget_tokens` derives it
    itl_budget_tokens: Annotated[float, flag(
        "Cost model: prompt tokens a decoding request may share its steps with before its time per output token "
        "reaches the ITL SLO; the interference terms price only the tokens beyond it. 0: every token.")] = 0.0
    # `services.router.routing.plan.kv_transfer_mode`
    pd_transfer: Annotated[Literal["pull", "push"], flag(
        "How a disaggregated request's prompt KV reaches the decode worker: pull (prefill first, the decode "
        "worker reads it), or push (the decode worker allocates first, the prefill worker writes each layer as "
        "it computes; pairs whose engines cannot push fall back to pull).", env="TANDEM_PD_TRANSFER",
        doc="Counted by `tandem_router_kv_transfer_mode_total{mode}`.")] = "pull"

    def validate(self) -> None:
        for name in ("prefill_weight", "transfer_weight", "pull_fixed_tokens", "eviction_weight", "queue_weight",
                     "decode_weight", "request_overhead_tokens", "hot_load_factor", "home_slack_tokens",
                     "host_load_weight", "itl_weight", "itl_budget_tokens"):
            require(getattr(self, name) >= 0, f"routing {name} must not be negative")
        require(self.replica_share_slack is None or self.replica_share_slack >= 0,
                "routing replica_share_slack must not be negative")
        require(self.shortlist_workers == 0 or self.shortlist_workers >= 4,
                "shortlist_workers must be 0 (off) or at least 4")
        require(0.0 <= self.cache_hit_threshold <= 1.0, "cache_hit_threshold must lie in [0, 1]")
        require(self.max_queue_factor == 0 or self.max_queue_factor >= 1,
                "max_queue_factor must be 0 (off) or at least 1")
        require(self.retry_after_s >= 1, "retry_after_s must be at least 1")
        require(self.speculative_ttl_s > 0, "speculative_ttl_s must be positive")
        require(bool(self.policy), "routing policy must be named")
        require(self.pd_transfer in ("pull", "push"), "pd_transfer must be pull or push")
        require(self.prefill_from in ("prefill", "any"), "prefill_from must be prefill or any")
        self.kv_aware.validate()


class AdmissionConfig(msgspec.Struct, kw_only=True, frozen=True):
    """The router's admission queue (`services.router.routing.admission`): how many requests it
    lets run at once, and what waits or is refused beyond that. Off by default: every request
    goes to the workers at once, as without it."""

    slots_per_seq: Annotated[float, flag(
        "Admission queue: let at most this x the serving workers' max_num_seqs run at once; the rest wait in the "
        "router, the most urgent priority first, API keys sharing by virtual token counters (0: off, every "
        "request goes to the workers at once).", name="--admission-slots-per-seq")] = 0.0
    max_queued: Annotated[int, flag(
        "Admission queue: most requests waiting; past it the one that would be served last is refused (429).",
        name="--admission-max-queued")] = 1024
    max_wait_s: Annotated[float, flag(
        "Admission queue: a request waiting longer is refused (429).", name="--admission-max-wait")] = 30.0
    reserve_share: Annotated[float, flag(
        "Admission queue: the share of slots only requests more urgent than the default (priority < 0) may take.",
        name="--admission-reserve")] = 0.0
    sheddable_priority: Annotated[int | None, flag(
        "Requests of this priority or less urgent (a greater number) never wait: refused (429) when no slot is "
        "free. Unset: none.")] = None

    def validate(self) -> None:
        require(self.slots_per_seq >= 0, "admission slots_per_seq must not be negative")
        require(self.max_queued >= 0, "admission max_queued must not be negative")
        require(self.max_wait_s > 0, "admission max_wait_s must be positive")
        require(0.0 <= self.reserve_share < 1.0, "admission reserve_share must lie in [0, 1)")


class ScaleFromZeroConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Models that may have no worker (`services.router.routing.cold_start`): served with the
    tokenizer of their directory; a request no worker can take is held while the orchestrator
    is asked to start one (`WakeModel`), at most `max_held` per model, each `hold_s` at most."""

    models: Annotated[tuple[str, ...], flag(
        "A model that may have zero workers, NAME=DIR or NAME=DIR@1p1d (repeat): listed and tokenized from DIR; "
        "its requests wait while the orchestrator starts its workers (the orchestrator's --scalable-model; with "
        "@<P>p<D>d they wait for a prefill worker too, to be served disaggregated).",
        name="--scalable-model")] = ()
    hold_s: Annotated[float, flag(
        "Seconds a scalable model's request waits for a worker to start; then 503 with Retry-After.",
        name="--cold-start-wait")] = 120.0
    max_held: Annotated[int, flag(
        "Requests of one scalable model held at once; past that, 503 with Retry-After.",
        name="--cold-start-queue")] = 256
    ask_every_s: float = 10.0  # while requests are held, the orchestrator is asked again this often
    # after the orchestrator's `ok`, how long this router waits to see the workers it started
    # (its membership watch may lag the orchestrator's), before its held requests take what is here
    view_wait_s: float = 5.0
    retry_after_s: int = 5  # the Retry-After of a held request's 503

    def scalable(self) -> dict[str, ScalableModel]:
        """Each scalable model, by name (`shared.scalable_models`)."""
        return scalable_models(self.models)

    def directories(self) -> dict[str, str]:
        """Each scalable model's directory, by name."""
        return {name: model.directory for name, model in self.scalable().items()}

    def validate(self) -> None:
        self.scalable()
        require(self.hold_s > 0 and self.ask_every_s > 0 and self.view_wait_s > 0, "cold start waits must be positive")
        require(self.max_held >= 1 and self.retry_after_s >= 1, "cold start queue and Retry-After must be positive")
