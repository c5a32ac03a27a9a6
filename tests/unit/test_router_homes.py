"""Prefix homes on plain data: the learned home and the traffic each worker's prefixes bring
(`routing.placement.homes`), and how a weakly cached prompt goes home (`routing.placement.home`)."""

from __future__ import annotations

import dataclasses
from functools import partial

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.router.config import RoutingConfig
from services.router.routing import RoutePlan, RouteRequest, WorkerView, decide
from services.router.routing.placement.copies import COPY_FORGOTTEN
from services.router.routing.placement.homes import LIVE_COUNT, PrefixHomes
from services.router.routing.placement.residency import RESIDENT_FILL
from services.router.routing.placement.resident_prefixes import RESIDENCY_EVERY
from services.router.routing.placement.snapshot import HomedShares, HomedTokens, snapshot_of
from tests.unit.worker_views import worker_view

PROMPT = 1088


worker = partial(worker_view, max_num_seqs=64, max_model_len=4096, kv_capacity_tokens=2560,
                 reported_free_kv_tokens=0)


def route(homes: PrefixHomes, key: int, cached: dict[str, int] | None = None, *, resident: bool = True) -> RouteRequest:
    """`resident`: as the router with `resident_homes` (off: every live prefix's tokens count)."""
    return RouteRequest(model="m", prompt_tokens=PROMPT, total_tokens=PROMPT + 16, cached_tokens=cached or {},
                        held_tokens=cached or {}, prefix_key=key, block_tokens=PROMPT,
                        placement=snapshot_of(homes, key, resident_homes=resident))


def pick(workers: list[WorkerView], request: RouteRequest, routing: RoutingConfig = RoutingConfig()) -> str:
    plan = decide(workers, request, routing)
    assert isinstance(plan, RoutePlan), plan
    return plan.worker_id


# ---- PrefixHomes ----------------------------------------------------------------------------


def test_a_prefix_is_homed_where_it_was_routed_last() -> None:
    homes = PrefixHomes()
    assert homes.home(1) is None
    homes.record(1, "a")
    homes.record(1, "b")
    assert homes.home(1) == "b"
    assert homes.homed_share() == {"a": 0.0, "b": 1.0}


def test_homed_shares_follow_recent_traffic_and_decay() -> None:
    homes = PrefixHomes(horizon=10)
    for _ in range(30):
        homes.record(1, "a")  # a popular prefix
    homes.record(2, "b")
    share = homes.homed_share()
    assert share["a"] > 0.85 and share["a"] + share["b"] == pytest.approx(1.0)
    for _ in range(60):
        homes.record(3, "b")  # traffic moves on: the old counts fade
    assert homes.homed_share()["a"] < 0.01


def test_moving_a_prefix_moves_its_whole_count_and_a_leaving_worker_unhomes_its_prefixes() -> None:
    homes = PrefixHomes(horizon=1000)
    for _ in range(9):
        homes.record(1, "a")
    homes.record(2, "b")
    homes.record(1, "b")  # prefix 1 (10 requests by now) moved
    assert homes.homed_share()["b"] == pytest.approx(1.0, abs=0.02)
    homes.forget("b")
    assert homes.home(1) is None and homes.home(2) is None
    assert homes.homed_share() == {"a": 0.0} or homes.homed_share() == {}


def test_a_prefixs_share_of_recent_requests_follows_traffic_and_leaves_with_its_worker() -> None:
    homes = PrefixHomes(horizon=1000)
    assert homes.share(1) == 0.0
    for _ in range(3):
        homes.record(1, "a")
    homes.record(2, "b")
    assert homes.share(1) == pytest.approx(0.75, abs=0.01) and homes.share(2) == pytest.approx(0.25, abs=0.01)
    homes.record(1, "b")  # moving home keeps the prefix's count
    assert homes.share(1) == pytest.approx(0.8, abs=0.01)
    homes.forget("b")  # both were homed on b: nothing is left
    assert homes.share(1) == 0.0 and homes.share(2) == 0.0
    homes.record(3, "a")
    assert homes.share(3) == pytest.approx(1.0)
    decaying = PrefixHomes(horizon=10)
    decaying.record(1, "a")
    for _ in range(50):
        decaying.record(2, "a")
    assert decaying.share(1) < 0.01


def test_only_the_most_recent_prefixes_are_remembered() -> None:
    homes = PrefixHomes(max_tracked=3)
    for key in range(5):
        homes.record(key, "a")
    assert [homes.home(key) for key in range(5)] == [None, None, "a", "a", "a"]
    with pytest.raises(ValueError):
        PrefixHomes(horizon=0)


def test_a_copy_served_elsewhere_keeps_the_home_and_counts_where_it_was_served() -> None:
    homes = PrefixHomes(horizon=10_000)
    homes.record(1, "a", 1000)
    homes.record(1, "b", 1000, copy=True)  # b was sent a copy while a still holds the prefix
    assert homes.home(1) == "a" and homes.share(1) == pytest.approx(1.0)
    assert homes.homed_share() == pytest.approx({"a": 0.5, "b": 0.5}, rel=1e-3)  # b carried one of the two requests
    assert homes.worker_share("b") == pytest.approx(0.5, rel=1e-3)  # b has no homed prefix, but carries the copy's
    # its KV is counted at its home, and where the copy holds it (b served a live request's worth)
    assert homes.homed_tokens("a") == 1000 and homes.homed_tokens("b") == 1000
    assert dict(HomedTokens(homes, resident=True)) == {"a": 1000, "b": 1000}
    homes.record(1, "b", 1000, copy=True)
    assert homes.homed_share() == pytest.approx({"a": 1 / 3, "b": 2 / 3}, rel=1e-3)
    homes.record(1, "b", 1000)  # computed on b: b is its home now
    assert homes.home(1) == "b" and homes.homed_share() == pytest.approx({"a": 0.0, "b": 1.0})
    assert homes.homed_tokens("b") == 1000 and homes.homed_tokens("a") == 0  # no copy elsewhere now
    homes.forget("b")  # b left: neither its prefix nor the copies it served count anywhere
    assert "b" not in homes.homed_share()
    homes.record(2, "c", 500, copy=True)  # a first request has no home to keep
    assert homes.home(2) == "c"


def test_past_the_clusters_kv_a_copy_counts_at_the_home() -> None:
    """The live prefixes need more KV than the cluster holds: a copy's requests count at the
    prefix's home, as its own do, and its KV is not counted where it was served (without
    `resident`, each worker's live homed prompts alone)."""
    homes = PrefixHomes(horizon=10_000)
    for key, name in ((1, "a"), (2, "a"), (3, "b")):
        homes.record(key, name, 1000)
    homes.record(1, "b", 1000, copy=True)
    assert homes.homed_share() == pytest.approx({"a": 0.5, "b": 0.5}, rel=1e-3)
    assert homes.homed_tokens("b") == 2000  # its own prompt and the copy
    sized(homes, "ab", 1000)  # three live prompts of 1000 tokens, 2000 in the cluster
    assert homes.limited() and homes.homed_share() == pytest.approx({"a": 0.75, "b": 0.25}, rel=1e-3)
    assert homes.homed_tokens("b", resident=False) == 1000 and dict(HomedTokens(homes, resident=False)) == {
        "a": 2000, "b": 1000}


def test_homed_tokens_count_the_live_prefixes_homed_on_each_worker() -> None:
    """The KV each worker's live homed prompts keep there: it follows a prefix that moves,
    drops one whose recent requests have decayed away, one forgotten as too old, and a
    worker that left; the per-worker mapping lists only workers with homed prefixes."""
    homes = PrefixHomes(horizon=10, max_tracked=3)
    homes.record(1, "a", 1000)
    homes.record(2, "a", 500)
    homes.record(3, "b", 700)
    assert (homes.homed_tokens("a"), homes.homed_tokens("b"), homes.homed_tokens("c")) == (1500, 700, 0)
    homes.record(2, "b", 600)  # moved: its latest prompt counts, on its new home
    assert (homes.homed_tokens("a"), homes.homed_tokens("b")) == (1000, 1300)
    for _ in range(20):
        homes.record(3, "b", 700)  # prefixes 1 and 2 see no requests: decayed below LIVE_COUNT
    assert (homes.homed_tokens("a"), homes.homed_tokens("b")) == (0, 700)
    homes.record(4, "c", 100)  # a fourth prefix: the least recently routed (1) is forgotten
    assert homes.home(1) is None and dict(HomedTokens(homes, resident=True)) == {"b": 700, "c": 100}
    homes.forget("b")
    assert dict(HomedTokens(homes, resident=True)) == {"c": 100}


def _walked_tokens(homes: PrefixHomes, worker_id: str) -> int:
    """`homed_tokens` by its definition: a walk over the worker's prefixes, summing the tokens
    of those whose decayed count is still at least LIVE_COUNT."""
    return sum(tokens for key, (home, count, at_step, tokens, _) in homes._prefixes.items()
               if home == worker_id and homes._now(count, at_step) >= LIVE_COUNT)


def _walked_work(homes: PrefixHomes) -> dict[str, float]:
    """`work_shares` by its definition: per worker, the decayed work of its prefixes."""
    work: dict[str, float] = {}
    for home, _, at_step, _, value in homes._prefixes.values():
        work[home] = work.get(home, 0.0) + homes._now(value, at_step)
    return work


class CopiesServed:
    """The test's own record of the requests served by copies: per (prefix, worker), the steps
    at which `worker` served a copy of the prefix while it was homed elsewhere. Dropped with
    a forgotten worker, with the prefixes homed on it, and with a prefix no longer tracked."""

    def __init__(self) -> None:
        self.steps: dict[tuple[int, str], list[int]] = {}

    def record(self, homes: PrefixHomes, key: int, worker_id: str, copy: bool) -> None:
        home = homes.home(key)
        if copy and home is not None and worker_id != home:
            self.steps.setdefault((key, worker_id), []).append(homes._step + 1)

    def forget(self, homes: PrefixHomes, worker_id: str) -> None:
        gone = {key for key, (home, *_) in homes._prefixes.items() if home == worker_id}
        self.steps = {(key, served): steps for (key, served), steps in self.steps.items()
                      if served != worker_id and key not in gone}

    def untracked(self, homes: PrefixHomes) -> None:
        self.steps = {entry: steps for entry, steps in self.steps.items() if entry[0] in homes._prefixes}

    def held(self, homes: PrefixHomes, worker_id: str) -> int:
        """The tokens of the prefixes homed elsewhere that `worker_id` holds as live copies
        (it served at least LIVE_COUNT of their requests, decayed), where not `limited`
        (call after `carried`, which drops the faded copies as PrefixHomes does)."""
        if homes.limited():
            return 0
        return sum(homes._prefixes[key][3] for (key, served), steps in self.steps.items()
                   if served == worker_id != homes._prefixes[key][0]
                   and sum(homes._keep ** (homes._step - step) for step in steps) >= LIVE_COUNT)

    def carried(self, homes: PrefixHomes) -> dict[str, float]:
        """`homed_share` by its definition (times the total): per worker, the decayed counts of
        its homed prefixes, plus the requests it served for copies of prefixes homed elsewhere,
        less those that copies of its own prefixes served elsewhere."""
        carried: dict[str, float] = {}
        for home, count, at_step, _, _ in homes._prefixes.values():
            carried[home] = carried.get(home, 0.0) + homes._now(count, at_step)
        decayed = {entry: sum(homes._keep ** (homes._step - step) for step in steps)
                   for entry, steps in self.steps.items()}
        per_prefix: dict[int, float] = {}
        for (key, _), served in decayed.items():
            per_prefix[key] = per_prefix.get(key, 0.0) + served
        faded = {key for key, served in per_prefix.items() if served < COPY_FORGOTTEN}  # as PrefixHomes drops them
        self.steps = {entry: steps for entry, steps in self.steps.items() if entry[0] not in faded}
        for (key, worker_id), steps in self.steps.items():
            home = homes._prefixes[key][0]
            if worker_id != home:
                served = decayed[key, worker_id]
                carried[worker_id] = carried.get(worker_id, 0.0) + served
                carried[home] -= served
        return carried


@settings(max_examples=200, deadline=None)
@given(horizon=st.integers(1, 12), max_tracked=st.integers(1, 6),
       steps=st.lists(st.one_of(
           st.tuples(st.just("record"), st.integers(0, 7), st.sampled_from("abc"), st.integers(1, 900),
                     st.booleans(), st.integers(0, 900)),
           st.tuples(st.just("forget"), st.sampled_from("abc"))), max_size=60))
def test_homed_tokens_and_shares_kept_as_prefixes_are_routed_equal_the_walk_over_them(horizon, max_tracked,
                                                                                      steps) -> None:
    """The live tokens kept per worker equal the walk over its prefixes; one worker's share
    asked alone (O(1)) equals its share among all of them, and the walk over its prefixes and
    the copies it served (or its prefixes' copies served elsewhere); the work kept per worker
    equals the walk over its prefixes' work."""
    homes = PrefixHomes(horizon=horizon, max_tracked=max_tracked)
    copies = CopiesServed()
    for step in steps:
        if step[0] == "record":
            _, key, worker_id, tokens, copy, computed = step
            copies.record(homes, key, worker_id, copy)
            homes.record(key, worker_id, tokens, computed=computed, copy=copy)
            copies.untracked(homes)
        else:
            copies.forget(homes, step[1])
            homes.forget(step[1])
        every = homes.homed_share()
        walked = _walked_work(homes)
        total = sum(walked.values())
        work = homes.work_shares()
        carried, tracked = copies.carried(homes), homes._now(*homes._total)
        for worker_id in "abc":
            assert every.get(worker_id, 0.0) == pytest.approx(
                min(1.0, max(0.0, carried.get(worker_id, 0.0)) / tracked) if tracked > 0 else 0.0, abs=1e-9)
            assert homes.homed_tokens(worker_id) == _walked_tokens(homes, worker_id) + copies.held(homes, worker_id)
            assert HomedShares(homes).get(worker_id, 0.0) == pytest.approx(every.get(worker_id, 0.0), abs=1e-9)
            assert work.get(worker_id, 0.0) == pytest.approx(walked.get(worker_id, 0.0) / total if total else 0.0,
                                                             abs=1e-9)


# ---- going home -----------------------------------------------------------------------------


def test_an_evicted_prefix_goes_back_to_its_home_not_to_the_least_loaded() -> None:
    homes = PrefixHomes()
    homes.record(5, "c")
    workers = [worker("a"), worker("b"), worker("c", reported_prefill_tokens=300, in_flight=1)]
    assert pick(workers, route(homes, 5)) == "c"  # queued a little: still home
    off = RoutingConfig(sticky_homes=False)
    assert pick(workers, route(homes, 5), off) != "c"  # off: rendezvous among the least queued


def test_a_busy_home_is_left_for_the_worker_with_the_least_homed_traffic() -> None:
    homes = PrefixHomes()
    for _ in range(20):
        homes.record(1, "a")  # a's prefixes bring most of the traffic
    homes.record(2, "b")
    homes.record(3, "c")
    homes.record(4, "a")
    workers = [worker("a", reported_prefill_tokens=6000), worker("b"), worker("c"), worker("d")]
    assert pick(workers, route(homes, 4)) == "d"  # a is busy; d has no homed traffic yet


def test_an_evicted_minor_tenant_leaves_an_overcommitted_home_and_the_major_one_stays() -> None:
    """a is home to prefixes 1 (the major tenant) and 4 (a minor one): together 0.6 of the
    traffic on 4 workers (cap 0.3). a is not busy; still, prefix 4's prompt must be computed
    anyway, so it moves to the worker with the least homed traffic, and its home with it.
    Prefix 1 stays; so does everything with the share rule off."""
    homes = PrefixHomes()
    for _ in range(10):
        homes.record(1, "a")
    for _ in range(2):
        homes.record(4, "a")
    for key, name in ((2, "b"), (3, "c"), (5, "b"), (6, "c"), (7, "d")):
        for _ in range(2):
            homes.record(key, name)
    workers = [worker(name) for name in "abcd"]
    assert homes.share(4) < homes.homed_share()["a"] / 2
    assert pick(workers, route(homes, 4)) == "d"
    assert pick(workers, route(homes, 1)) == "a"
    by_load = RoutingConfig(replica_share_slack=None)
    assert pick(workers, route(homes, 4), by_load) == "a"


def test_a_busy_home_keeps_a_tenant_it_can_carry_and_a_hot_one_may_leave() -> None:
    """Four workers, four prefixes with equal shares (0.25 each, under the 0.3 cap): a's queue
    is long for a moment, but the tenant stays; by load alone it would leave. A prefix that
    draws more than one worker carries (0.55) leaves a busy home as before."""
    homes = PrefixHomes()
    for key, name in ((1, "a"), (2, "b"), (3, "c"), (4, "d")):
        for _ in range(5):
            homes.record(key, name)
    workers = [worker("a", reported_prefill_tokens=6000), worker("b"), worker("c"), worker("d")]
    assert pick(workers, route(homes, 1)) == "a"
    assert pick(workers, route(homes, 1), RoutingConfig(replica_share_slack=None)) != "a"
    for _ in range(15):
        homes.record(1, "a")  # prefix 1 now draws 20 of 35 requests
    assert homes.share(1) > 0.5
    assert pick(workers, route(homes, 1)) != "a"


def test_a_prompt_mostly_held_somewhere_ignores_its_home() -> None:
    homes = PrefixHomes()
    homes.record(6, "a")
    workers = [worker(name) for name in "abc"]
    assert pick(workers, route(homes, 6, {"b": 1024})) == "b"


def test_new_prefixes_fill_the_workers_evenly_by_traffic() -> None:
    """Each new prefix takes the worker whose homed prefixes bring the least traffic."""
    homes = PrefixHomes()
    workers = {name: worker(name) for name in "abcd"}
    for key in range(8):
        chosen = pick(list(workers.values()), route(homes, 1000 + key))
        homes.record(1000 + key, chosen)
    assert sorted(homes.homed_share().values()) == pytest.approx([0.25] * 4, abs=0.01)  # 2 each


def test_a_new_home_is_only_chosen_among_the_least_queued() -> None:
    """A worker with no homed traffic but a long queue is no new home (the mean bound)."""
    homes = PrefixHomes()
    homes.record(1, "a")
    workers = [worker("a"), dataclasses.replace(worker("b"), outstanding_prefill_tokens=3000, in_flight=2)]
    assert pick(workers, route(homes, 2)) == "a"
    assert pick(workers, route(homes, 2), msgspec.structs.replace(RoutingConfig(), home_slack_tokens=0)) == "a"


def test_a_cached_minor_tenant_moves_off_an_overcommitted_overflowing_home_where_its_share_fits() -> None:
    """Prefix 4 is a minor tenant of a (a's prefixes draw 0.55 of the traffic, the cap is 0.3)
    and still cached there, and a's two homed prompts need more KV than a holds: it moves, once,
    to the worker with the least homed traffic, though its prompt fits there no better; the
    major tenant stays. Where no other worker has room for its share, it stays."""
    homes = PrefixHomes(horizon=10_000)
    for key, name, count in ((1, "a", 10), (4, "a", 2), (2, "b", 2), (5, "b", 2), (3, "c", 2), (6, "c", 2),
                             (7, "d", 2)):
        for _ in range(count):
            homes.record(key, name, PROMPT)
    assert homes.homed_tokens("a") == 2 * PROMPT
    small = [worker(name, kv_capacity_tokens=2048) for name in "abcd"]
    assert pick(small, route(homes, 4, {"a": 1024})) == "d"
    assert pick(small, route(homes, 1, {"a": 1024})) == "a"
    moved, stayed = decide(small, route(homes, 4, {"a": 1024})), decide(small, route(homes, 1, {"a": 1024}))
    assert isinstance(moved, RoutePlan) and isinstance(stayed, RoutePlan)
    assert moved.moves_home and not stayed.moves_home  # a, which still holds it, must not keep it as a copy
    assert pick(small, route(homes, 4, {"a": 1024}), RoutingConfig(replica_share_slack=None)) == "a"
    crowded = PrefixHomes(horizon=10_000)
    for key, name, count in ((1, "a", 10), (4, "a", 2), (2, "b", 10), (3, "c", 10), (5, "d", 10)):
        for _ in range(count):
            crowded.record(key, name, PROMPT)
    assert pick(small, route(crowded, 4, {"a": 1024})) == "a"


def test_a_cached_minor_tenant_of_a_home_overcommitted_by_traffic_moves_where_its_prompt_fits() -> None:
    """a's cache holds both its prompts, but its prefixes draw 0.55 of the traffic: its requests
    queue there behind one another. Prefix 4, a minor tenant, moves to a worker with room for
    both its share and its prompt: d, not b (the least traffic, but no room for a third
    prompt). Where no other worker has room for its prompt, it stays; the major tenant stays."""
    homes = PrefixHomes(horizon=10_000)
    for key, name, count in ((1, "a", 10), (4, "a", 2), (2, "b", 1), (5, "b", 1), (3, "c", 2), (6, "c", 2),
                             (7, "d", 2)):
        for _ in range(count):
            homes.record(key, name, PROMPT)
    roomy = [worker(name, kv_capacity_tokens=2 * PROMPT) for name in "abcd"]
    moved = decide(roomy, route(homes, 4, {"a": 1024}))
    assert isinstance(moved, RoutePlan) and moved.worker_id == "d" and moved.moves_home
    assert pick(roomy, route(homes, 1, {"a": 1024})) == "a"
    homes.record(8, "d", PROMPT)  # d's cache now holds two prompts as well: no room anywhere
    assert pick(roomy, route(homes, 4, {"a": 1024})) == "a"


def crowded_homes() -> PrefixHomes:
    """a homes three prompts (its whole KV in `crowded_workers`), b one, c and d two each; a's
    prefixes draw the least traffic per prefix, so a is under the share cap (0.3 of 4 workers)."""
    homes = PrefixHomes(horizon=10_000)
    for key, name, count in ((1, "a", 10), (2, "a", 10), (3, "a", 10), (4, "b", 30), (5, "c", 20), (6, "c", 20),
                             (7, "d", 20), (8, "d", 20)):
        for _ in range(count):
            homes.record(key, name, PROMPT)
    return homes


def crowded_workers(**overrides) -> list[WorkerView]:
    return [worker(name, kv_capacity_tokens=3 * PROMPT, **overrides.get(name, {})) for name in "abcd"]


def test_an_evicted_prefix_leaves_a_home_too_full_to_hold_it_for_a_roomier_worker() -> None:
    """Prefix 3 was evicted from its home a, whose three homed prompts fill its KV: taking it
    back would evict another of a's tenants. It goes to b, the one worker that holds fewer
    homed prompt tokens with it than a does now (c and d would hold as many), though a is
    neither busy nor over the share cap; and stays there (b is not full with it). Still
    cached on a, it is not moved."""
    homes = crowded_homes()
    assert homes.homed_share()["a"] < 0.3 and homes.homed_tokens("a") == 3 * PROMPT
    plan = decide(crowded_workers(), route(homes, 3))
    assert isinstance(plan, RoutePlan) and plan.worker_id == "b"
    homes.record(3, "b", PROMPT)
    assert homes.homed_tokens("b") == 2 * PROMPT
    assert pick(crowded_workers(), route(homes, 3)) == "b"
    assert pick(crowded_workers(), route(crowded_homes(), 3, {"a": 1024})) == "a"
    without_b = [view for view in crowded_workers() if view.worker_id != "b"]
    assert pick(without_b, route(crowded_homes(), 3)) == "a"  # c or d would be as full as a is


def test_a_crowded_home_is_kept_where_no_roomier_worker_has_room_for_the_share() -> None:
    """As above, with b's prefix drawing 0.24 of the traffic: prefix 3 would push b past the
    cap, and no other worker is roomier, so a computes it again."""
    homes = crowded_homes()
    for _ in range(5):
        homes.record(4, "b", PROMPT)
    assert homes.homed_share()["b"] + homes.share(3) > 0.3
    assert pick(crowded_workers(), route(homes, 3)) == "a"


def test_a_prefix_leaving_a_crowded_home_goes_where_it_fits_though_that_worker_queues_more() -> None:
    """b, the only roomier worker, queues more prefill than the mean for a moment: the prefix
    still goes there (a queue passes; a full cache keeps evicting), not to c or d."""
    queued = crowded_workers(b=dict(reported_prefill_tokens=2000, in_flight=1))
    assert pick(queued, route(crowded_homes(), 3)) == "b"


def test_past_the_clusters_kv_a_crowded_home_computes_its_evicted_prefix_again() -> None:
    """As in the crowded test, with five more rare prefixes on c and d: 13 live prompts on KV for
    12, so only some prefixes can stay cached anywhere. Prefix 3 is resident, and the overflow
    rules judge a move by the resident prefixes (a's fit its KV), not the crowding of homed
    prompts: it is computed at home. Without the KV known, it goes to b as before."""
    homes = crowded_homes()
    for key in range(9, 14):
        for _ in range(2):
            homes.record(key, "cd"[key % 2], PROMPT)
    sized(homes, "abcd", 3 * PROMPT)
    request = route(homes, 3)
    assert request.placement.limited and request.placement.resident and request.placement.homed_tokens["a"] == 3 * PROMPT
    assert pick(crowded_workers(), request) == "a"
    unknown = dataclasses.replace(request.placement, residency=None)  # residency unknown
    assert pick(crowded_workers(), dataclasses.replace(request, placement=unknown)) == "b"


def test_past_the_clusters_kv_a_cached_minor_tenant_does_not_move_on_traffic_alone() -> None:
    """As above, with one more live prompt than the cluster's KV holds: a move would cost a
    miss, and a's prompts fit in its KV, so prefix 4 stays."""
    homes = PrefixHomes(horizon=10_000)
    for key, name, count in ((1, "a", 10), (4, "a", 2), (2, "b", 1), (5, "b", 1), (3, "c", 2), (6, "c", 2),
                             (7, "d", 2), (8, "d", 1), (9, "d", 1)):
        for _ in range(count):
            homes.record(key, name, PROMPT)
    sized(homes, "abcd", 2 * PROMPT)
    assert homes.limited() and homes.resident(4) and homes.homed_tokens("a") == 2 * PROMPT
    roomy = [worker(name, kv_capacity_tokens=2 * PROMPT) for name in "abcd"]
    assert pick(roomy, route(homes, 4, {"a": 1024})) == "a"


def test_a_busy_home_lets_a_minor_tenant_go_though_it_is_not_overcommitted() -> None:
    """a's prefixes draw 0.25 of the traffic (under the 0.3 cap), prefix 4 a quarter of that:
    with a's queue long, 4's evicted prompt is computed elsewhere; with a idle, at home."""
    homes = PrefixHomes(horizon=10_000)
    for key, name, count in ((1, "a", 6), (4, "a", 2), (2, "b", 8), (3, "c", 8), (5, "d", 8)):
        for _ in range(count):
            homes.record(key, name)
    assert homes.homed_share()["a"] < 0.3
    busy = [worker("a", reported_prefill_tokens=6000), worker("b"), worker("c"), worker("d")]
    assert pick(busy, route(homes, 4)) != "a"
    assert pick([worker(name) for name in "abcd"], route(homes, 4)) == "a"


def test_a_new_home_skips_a_cheaper_worker_its_share_would_overcommit() -> None:
    """Prefix 4 leaves its overcommitted home a. b holds a third of its prompt, so b is the
    cheapest by more than the slack; but b's prefixes already draw 0.31 of the traffic, so 4
    goes to d, which has room (and to b with the share rule off, leaving a because it is busy)."""
    homes = PrefixHomes(horizon=10_000)
    for key, name, count in ((1, "a", 10), (4, "a", 2), (2, "b", 10), (3, "c", 10)):
        for _ in range(count):
            homes.record(key, name)
    workers = [worker("a", reported_prefill_tokens=6000), worker("b"), worker("c"), worker("d")]
    assert pick(workers, route(homes, 4, {"b": 384})) == "d"
    assert pick(workers, route(homes, 4, {"b": 384}), RoutingConfig(replica_share_slack=None)) == "b"


# ---- resident prefixes ----------------------------------------------------------------------


def sized(homes: PrefixHomes, workers: str, kv_tokens: int = 2560) -> PrefixHomes:
    for name in workers:
        homes.set_capacity(name, kv_tokens)
    return homes


def test_only_the_most_requested_prefixes_that_fit_in_the_cluster_are_resident() -> None:
    """12 live prompts of 1088 tokens on 4 workers of 2560: 75% of the cluster's KV holds 7 of
    them. The 7 most requested are resident and count in their homes' tokens; the other 5
    miss wherever they go and count nowhere. Without any KV pool known, every live one counts."""
    assert RESIDENT_FILL == 0.75
    homes = PrefixHomes(horizon=10_000)
    for key in range(12):
        for _ in range(20 - key):  # prefix 0 the most requested
            homes.record(key, "abcd"[key % 4], PROMPT)
    assert homes.homed_tokens("a") == 3 * PROMPT  # no pool known: 0, 4 and 8, all live
    sized(homes, "abcd")
    assert [key for key in range(12) if homes.resident(key)] == list(range(7))
    assert [snapshot_of(homes, key).resident for key in (6, 7)] == [True, False]
    assert {name: homes.homed_tokens(name) for name in "abcd"} == {"a": 2 * PROMPT, "b": 2 * PROMPT,
                                                                  "c": 2 * PROMPT, "d": PROMPT}
    assert homes.homed_tokens("a", resident=False) == 3 * PROMPT
    assert not homes.resident(99)  # never seen


def test_residents_are_ranked_again_as_popularity_shifts_and_moves_count_at_once() -> None:
    """A resident prefix that moves counts on its new home at once; a transient one that
    becomes popular is resident from the next ranking (`RESIDENCY_EVERY` routed requests)."""
    homes = PrefixHomes(horizon=10_000)
    for key, count in ((1, 9), (2, 8), (3, 7), (4, 6), (5, 2)):
        for _ in range(count):
            homes.record(key, "a" if key < 3 else "b", PROMPT)
    assert not homes.limited()  # no KV pool known: every live prefix counts
    sized(homes, "ab", kv_tokens=2600)  # 5 prompts need 5440 of 5200 tokens: 75% holds 3
    assert homes.limited()
    assert [homes.resident(key) for key in range(1, 6)] == [True, True, True, False, False]
    homes.record(2, "b", PROMPT)  # moved: a keeps prefix 1 only
    assert (homes.homed_tokens("a"), homes.homed_tokens("b")) == (PROMPT, 2 * PROMPT)
    for _ in range(RESIDENCY_EVERY + 10):
        homes.record(5, "a", PROMPT)  # prefix 5 is the most requested now
    assert homes.resident(5) and not homes.resident(3)
    assert (homes.homed_tokens("a"), homes.homed_tokens("b")) == (2 * PROMPT, PROMPT)


def test_prompts_seen_once_fill_the_cluster_but_claim_no_kv() -> None:
    """Unique prompts (each seen once) are live and take the cluster past its KV, but only
    recurring prefixes are resident; a cold cluster, everything seen once, has none yet.
    Where the live prompts all fit, every one counts."""
    homes = sized(PrefixHomes(horizon=10_000), "ab", kv_tokens=2600)
    for key in (1, 2, 3):
        homes.record(key, "a", PROMPT)
    assert not homes.limited() and homes.homed_tokens("a") == 3 * PROMPT
    for key in range(100, 100 + RESIDENCY_EVERY):
        homes.record(key, "b", PROMPT)  # unique prompts, once each (ranked again after as many)
    assert homes.limited() and homes.homed_tokens("a") == homes.homed_tokens("b") == 0
    for key in (1, 2, 3):
        for _ in range(RESIDENCY_EVERY):
            homes.record(key, "a", PROMPT)
    assert homes.homed_tokens("a") == 3 * PROMPT and homes.homed_tokens("b") == 0
    assert homes.homed_tokens("b", resident=False) == RESIDENCY_EVERY * PROMPT


def test_a_resident_minor_tenant_leaves_a_home_whose_residents_overflow_its_kv_for_one_it_fits_on() -> None:
    """10 recurring prompts on 4 workers of 2560 tokens: 7 are resident. a's three resident
    prompts need 3264 of its 2560 tokens, though a's prefixes draw only 0.27 of the traffic
    (not overcommitted). Prefix 2, cached on a and a quarter of a's traffic, moves to d, the
    one worker with room for both its share and its prompt (b's residents fill it, c has no
    room for the share); the major tenant stays; with `resident_homes` off, prefix 2 stays too."""
    homes = sized(PrefixHomes(horizon=10_000), "abcd")
    for key, name, count in ((1, "a", 7), (2, "a", 3), (3, "a", 3), (4, "b", 10), (7, "b", 3), (5, "c", 10),
                             (8, "c", 2), (6, "d", 6), (9, "d", 2), (10, "d", 2)):
        for _ in range(count):
            homes.record(key, name, PROMPT)
    assert homes.limited() and [key for key in range(1, 11) if homes.resident(key)] == [1, 2, 3, 4, 5, 6, 7]
    assert homes.homed_share()["a"] < 0.3 and homes.homed_tokens("a") == 3 * PROMPT
    workers = [worker(name) for name in "abcd"]
    assert pick(workers, route(homes, 2, {"a": 1024})) == "d"
    assert pick(workers, route(homes, 1, {"a": 1024})) == "a"
    off = RoutingConfig(resident_homes=False)
    assert pick(workers, route(homes, 2, {"a": 1024}, resident=False), off) == "a"


def test_a_transient_prefix_stays_on_a_home_whose_residents_fit() -> None:
    """Past the cluster's KV a transient prefix misses wherever it goes: a's residents fit in
    its KV, so prefix 4 stays. Counting every live prefix (`resident_homes` off), a overflows
    and prefix 4, a minor tenant of an overcommitted home, leaves for b."""
    homes = sized(PrefixHomes(horizon=10_000), "ab")  # 5 prompts need 5440 of 5120 tokens: 3 resident
    for key, name, count in ((1, "a", 9), (2, "a", 8), (3, "b", 7), (4, "a", 2), (5, "b", 2)):
        for _ in range(count):
            homes.record(key, name, PROMPT)
    assert not homes.resident(4) and homes.homed_tokens("a") == 2 * PROMPT
    workers = [worker(name) for name in "ab"]
    assert pick(workers, route(homes, 4, {"a": 1024})) == "a"
    off = RoutingConfig(resident_homes=False)
    assert pick(workers, route(homes, 4, {"a": 1024}, resident=False), off) == "b"


def test_a_resident_prefix_leaving_its_home_goes_where_its_prompt_fits() -> None:
    """Prefix 2, evicted, leaves its overcommitted home a. b's prefixes draw the least traffic
    but its two resident prompts leave no room for a third; c has room for both its share and
    its prompt, so it goes to c (to b with `resident_homes` off)."""
    homes = sized(PrefixHomes(horizon=10_000), "abcd")
    for key, name, count in ((1, "a", 10), (2, "a", 3), (3, "b", 3), (4, "b", 3), (5, "c", 7), (6, "d", 9),
                             (7, "d", 2), (8, "d", 2), (9, "d", 2), (10, "d", 2)):
        for _ in range(count):
            homes.record(key, name, PROMPT)
    assert homes.limited() and all(homes.resident(key) for key in range(1, 7))
    workers = [worker(name) for name in "abcd"]
    assert pick(workers, route(homes, 2)) == "c"
    assert pick(workers, route(homes, 2, resident=False), RoutingConfig(resident_homes=False)) == "b"


def _walked_resident_tokens(homes: PrefixHomes, worker_id: str) -> int:
    residents = homes._residency.keys or set()
    return sum(homes._prefixes[key][3] for key in residents if homes._prefixes[key][0] == worker_id)


def _walked_carried(homes: PrefixHomes) -> dict[str, float]:
    """`homed_share` by its definition (times the total): per worker, the decayed counts of
    its homed prefixes, plus the requests it served for copies of prefixes homed elsewhere,
    less those that copies of its own prefixes served elsewhere."""
    carried: dict[str, float] = {}
    for key, (home, count, at_step, _, _) in homes._prefixes.items():
        carried[home] = carried.get(home, 0.0) + homes._now(count, at_step)
        for worker_id, served in homes._copies.get(key, {}).items():
            if worker_id != home:
                carried[worker_id] = carried.get(worker_id, 0.0) + homes._now(*served)
                carried[home] -= homes._now(*served)
    return carried


@settings(max_examples=200, deadline=None)
@given(horizon=st.integers(1, 12), max_tracked=st.integers(1, 6),
       steps=st.lists(st.one_of(
           st.tuples(st.just("record"), st.integers(0, 7), st.sampled_from("abc"), st.integers(1, 900),
                     st.booleans()),
           st.tuples(st.just("capacity"), st.sampled_from("abc"), st.integers(0, 3000)),
           st.tuples(st.just("forget"), st.sampled_from("abc"))), max_size=60))
def test_resident_tokens_kept_as_prefixes_are_routed_equal_the_walk_over_the_residents(horizon, max_tracked,
                                                                                      steps) -> None:
    """Between rankings, the resident tokens kept per worker as prefixes move, fade and are
    forgotten equal the walk over the resident prefixes' current homes, and every resident
    prefix is live."""
    homes = PrefixHomes(horizon=horizon, max_tracked=max_tracked)
    for step in steps:
        if step[0] == "record":
            _, key, worker_id, tokens, copy = step
            homes.record(key, worker_id, tokens, copy=copy)
        elif step[0] == "capacity":
            homes.set_capacity(step[1], step[2])
        else:
            homes.forget(step[1])
        for worker_id in "abc":
            tokens = homes.homed_tokens(worker_id)
            if homes._residency.keys is not None:
                assert tokens == _walked_resident_tokens(homes, worker_id)
                assert homes._residency.keys <= homes._live
