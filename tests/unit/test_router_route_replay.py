"""The router's routing decisions, replayed: `bench.router.route_micro` routes seeded workloads
through the dispatcher's own `_attempt` and `_commit` (KV index, views, `decide`, ledger,
predictions, placement) on three fleets, and the digest of every decision (worker, flow,
reason, cost, prompt plan) must stay what it was. A change meant only to make routing cheaper
must keep it; a change meant to route differently updates it (and says so)."""

from __future__ import annotations

from bench.router.route_micro import FLEETS, decisions, digest

# 4 seeds x 300 requests x 3 fleets: 3,600 decisions (40 seeds, 36,000: 2cf29c40...)
DECISIONS_DIGEST = "c79477da98997cf885cb4ef79789d24ccfa5885b18d9ee14f38bbd5ec29303a3"


def test_the_routing_decisions_of_the_seeded_workloads_are_unchanged() -> None:
    assert digest(range(4)) == DECISIONS_DIGEST


def test_the_workloads_exercise_every_kind_of_decision() -> None:
    reasons = {decision[3] for roles in FLEETS for decision in decisions(0, 300, roles)}
    assert {"no_prefill_worker", "small_uncached", "single_cheaper", "pair"} <= reasons
    assert any(decision[5].cached_tokens for decision in decisions(0, 300, FLEETS[0]))  # cache hits
