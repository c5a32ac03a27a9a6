"""The home rules: where a prompt that no worker holds most of goes, and when a prefix leaves
its home. Pure.

Per request, over its placement snapshot (`RouteRequest.placement`, `snapshot.PrefixPlacement`)
and the candidate parts the cost model priced (`candidates.Candidates`; the kv-aware policy's
`policies.cheapest.Cheapest.part` asks them): `weak` (no worker holds half of the prompt: it
goes to its prefix's home), `leaves` (why a prefix, cached or not, leaves its learned home
now) and `home` (which of the parts is its home, `home.prefer_home`, given why it leaves). A
new home picked as a prefix leaves is noted (`moves_home`): the policy's selection says so
(`Selection.moves_home`), then the plan (`RoutePlan.moves_home`), and
`placement.Placement.record` moves the prefix there, not a copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from services.router.routing.config import RoutingConfig
from services.router.routing.placement.home import IF_BUSY, LEAVE, STAY, HomeHints, prefer_home
from services.router.routing.placement.shares import copies_needed, homes_overflow, minor_tenant, share_cap
from services.router.routing.request import RouteRequest
from services.router.routing.view import WorkerView

# why a prefix leaves its home (`HomeRules.leaves`)
OVERFLOW = "overflow"  # its home's prompts overflow its KV
TRAFFIC = "traffic"  # a minor tenant of a home that carries more than one worker's part of the traffic
TRANSIENTS = "transients"  # a transient prefix, its home's transients bring far more work than another's
CROWDED = "crowded"  # a weakly cached prefix, its home's prompts leave no room for another, another's do


class Priced(Protocol):
    """A candidate part as the cost model priced it (`candidates.Single`)."""

    @property
    def worker(self) -> WorkerView: ...

    @property
    def cost(self) -> float: ...


Part = TypeVar("Part", bound=Priced)


class HomeRules:
    """The home rules for one request (its new homes noted across the policy's asks)."""

    def __init__(self, request: RouteRequest, routing: RoutingConfig) -> None:
        self.request = request
        self.routing = routing
        self.placement = request.placement  # what the placement says of its prefix
        self._new_homes: set[str] = set()  # picked as the prefix's new home as it leaves its home

    @property
    def weak(self) -> bool:
        """No worker holds (or is predicted to hold) half of the prompt: it goes to its
        prefix's home (`home.prefer_home`), when the prompt is at least a block long and homes are on."""
        return (self.request.prefix_key is not None and self.routing.home_slack_tokens > 0
                and 2 * max(self.request.cached_tokens.values(), default=0) < self.request.prompt_tokens)

    def leaves(self, parts: Sequence[Part]) -> str | None:
        """Why the prefix, cached or not, leaves its learned home now (OVERFLOW, TRAFFIC,
        TRANSIENTS or CROWDED; None: it stays): it is a minor tenant there (`shares.minor_tenant`: its home
        carries more than one worker's part of the traffic), another of `parts` has room for its
        share and its prompt (`_fits_on`), and the live prefixes fit in the cluster's KV
        (`PrefixPlacement.limited`: past it, a move costs a miss, and the overflow rules below
        apply; with this rule there too, and copies counted where served, the sim sweep's
        overfull point cached 0.70 to 0.71 of the prompt tokens against 0.73 to 0.76); or the
        prompts homed there need more KV than the home holds (`shares.homes_overflow`; past the
        cluster's KV, the resident ones), it is a minor tenant or (past the cluster's KV,
        `_past_kv`) a resident prefix drawing at most half of its home's traffic, and another of
        `parts` has room for its share (and, for the latter, its prompt). Moving it costs one
        computed prompt; leaving it queues the home's requests behind one another (and lets its
        tenants evict one another) for as long as the traffic lasts, since bounded affinity
        keeps a cached prefix's requests on its holder while the prefix draws no more than one
        worker carries. Cold starts place tenants before their shares are known, so this is how
        the partition rebalances once they are. A transient prefix (`_transient`) also leaves a
        home whose prefixes bring far more work than another's (`_transients_unbalanced`): it
        misses wherever it goes, so moving it costs little, and a worker that computes several
        transients' prompts at once evicts its own residents. A weakly cached prefix within the
        cluster's KV leaves a home too full to hold it (`_crowded`): the home evicted it for
        want of room, and taking it back would evict the next of its tenants."""
        request, slack = self.request, self.routing.replica_share_slack
        home = self.placement.home
        if (not self.routing.sticky_homes or request.prefix_key is None or home is None
                or self.placement.share is None or slack is None or len(parts) < 2):
            return None
        if self._transients_unbalanced(parts):
            return TRANSIENTS
        return self._overcommitted(parts) or (CROWDED if self._crowded(parts) else None)

    def _overcommitted(self, parts: Sequence[Part]) -> str | None:
        """OVERFLOW or TRAFFIC where `leaves` says so (None otherwise)."""
        slack = self.routing.replica_share_slack
        home = self.placement.home
        assert self.placement.share is not None and slack is not None
        homed = self.placement.homed_share.get(home, 0.0)
        minor = minor_tenant(self.placement.share, homed, len(parts), slack)
        shed = 2 * self.placement.share <= homed and self._past_kv and self.placement.resident
        if not (minor or shed):
            return None
        overflow = any(part.worker.worker_id == home
                       and homes_overflow(part.worker, self.placement.homed_tokens.get(home)) for part in parts)
        if not (overflow or (minor and not self.placement.limited)):
            return None
        cap = share_cap(len(parts), slack)
        room = any(part.worker.worker_id != home
                   and self.placement.homed_share.get(part.worker.worker_id, 0.0) + self.placement.share <= cap
                   and ((minor and overflow) or self._fits_on(part.worker))
                   for part in parts)
        return (OVERFLOW if overflow else TRAFFIC) if room else None

    def home(self, parts: Sequence[Part], leaving: str | None) -> Part:
        """Of `parts` (non-empty), the prefix's home (`home.prefer_home`); `leaving`: why the
        prefix leaves its learned home (`leaves`), None where it does not. A new home picked as
        it leaves is noted (`moves_home`): its old home may still hold the prompt, and the move
        must not be taken for a copy."""
        request, routing = self.request, self.routing
        assert request.prefix_key is not None
        if not routing.sticky_homes:
            hints = HomeHints(request.prefix_key)
        elif self._transient:  # its home computes its misses: balanced by the work homed on each
            hints = HomeHints(request.prefix_key, self.placement.home, self.placement.homed_work,
                              leave=self._leave(leaving, parts), prefix_share=self.placement.share)
        elif leaving == CROWDED:
            hints = HomeHints(request.prefix_key, self.placement.home, self.placement.homed_share,
                              leave=LEAVE, prefix_share=self.placement.share, share_cap=self._share_cap(len(parts)),
                              fits=self._roomier(parts), fit_first=True)
        else:
            must_fit = leaving == TRAFFIC and not self.weak
            hints = HomeHints(request.prefix_key, self.placement.home, self.placement.homed_share,
                              leave=self._leave(leaving, parts), prefix_share=self.placement.share,
                              share_cap=self._share_cap(len(parts)), fits=self._fits(parts, must_fit),
                              fit_first=must_fit)
        chosen = prefer_home(parts, lambda part: part.cost, lambda part: part.worker.worker_id,
                             lambda part: part.worker.predicted_prefill_tokens, hints, routing.home_slack_tokens,
                             routing.hot_load_factor, request.prompt_tokens)
        if leaving is not None and chosen.worker.worker_id != self.placement.home:
            self._new_homes.add(chosen.worker.worker_id)
        return chosen

    def moves_home(self, worker_id: str) -> bool:
        """Whether `worker_id` was picked as the prefix's new home as it leaves its home."""
        return worker_id in self._new_homes

    def _leave(self, leaving: str | None, parts: Sequence[Part]) -> str:
        return LEAVE if leaving is not None else self._leave_home(len(parts))

    @property
    def _past_kv(self) -> bool:
        """`resident_homes` applies: the live prefixes need more KV than the cluster holds."""
        return self.routing.resident_homes and self.placement.limited

    @property
    def _transient(self) -> bool:
        """Past the cluster's KV (`_past_kv`), the prefix recurs but is not resident
        (`PrefixPlacement.transient`): it misses wherever it goes, and its home is where that
        load falls."""
        return self._past_kv and self.placement.transient

    def _transients_unbalanced(self, parts: Sequence[Part]) -> bool:
        """For a `_transient` prefix: the prefixes homed on its home bring more than twice its
        share of the recent work more than another of `parts`' do (`PrefixPlacement.homed_work`:
        a miss weighs several hits). Moving it there then leaves its home at least as loaded as
        the new one, so no transient moves straight back."""
        home = self.placement.home
        own = self.placement.prefix_work if self._transient else None
        if home is None or own is None:
            return False
        work = self.placement.homed_work
        lightest = min((work.get(part.worker.worker_id, 0.0) for part in parts if part.worker.worker_id != home),
                       default=None)
        return lightest is not None and work.get(home, 0.0) - lightest > 2 * own

    def _fits(self, parts: Sequence[Part], must_fit: bool = False) -> frozenset[str] | None:
        """Where the prefix must fit (`must_fit`: a cached prefix leaves a home that holds it,
        and must not evict elsewhere what it spares there), or past the cluster's KV
        (`_past_kv`) for a resident prefix, the workers of `parts` whose KV holds its prompt
        beside their (resident) homed prefixes' (its home: beside the others'); None otherwise
        (a transient prefix misses wherever it goes)."""
        if not must_fit and (not self._past_kv or not self.placement.resident):
            return None
        return frozenset(part.worker.worker_id for part in parts if self._fits_on(part.worker))

    def _fits_on(self, worker: WorkerView, adds: int | None = None) -> bool:
        """Whether `worker`'s KV holds its homed prompts and `adds` more tokens (by default the
        prefix's prompt, none on its home, where it is counted already)."""
        request = self.request
        if adds is None:
            adds = 0 if worker.worker_id == self.placement.home else request.prompt_tokens
        return (worker.kv_capacity_tokens <= 0
                or self.placement.homed_tokens.get(worker.worker_id, 0) + adds <= worker.kv_capacity_tokens)

    def _crowded(self, parts: Sequence[Part]) -> bool:
        """For a weakly cached prefix (`weak`: its home no longer holds it, so its prompt is
        computed wherever it goes) within the cluster's KV: its home's homed prompts (`_fits_on`)
        leave no room there for one more, and another of `parts` with room for its share would
        hold fewer prompt tokens with it than the home holds now (`_roomier`)."""
        request = self.request
        home = next((part.worker for part in parts if part.worker.worker_id == self.placement.home), None)
        if home is None or not self.weak or self.placement.limited:
            return False
        return not self._fits_on(home, request.prompt_tokens) and bool(self._roomier(parts))

    def _roomier(self, parts: Sequence[Part]) -> frozenset[str]:
        """The workers of `parts` other than the prefix's home with room for its share that
        would hold fewer homed prompt tokens with its prompt than its home holds now: moving
        it there lowers the fuller of the two, so it never moves straight back."""
        request = self.request
        placement = self.placement
        crowd = placement.homed_tokens.get(placement.home, 0) if placement.home is not None else 0
        cap = self._share_cap(len(parts))
        share = placement.share or 0.0
        return frozenset(part.worker.worker_id for part in parts
                         if part.worker.worker_id != placement.home
                         and placement.homed_tokens.get(part.worker.worker_id, 0) + request.prompt_tokens < crowd
                         and (cap is None or placement.homed_share.get(part.worker.worker_id, 0.0) + share <= cap))

    def _share_cap(self, workers: int) -> float | None:
        slack = self.routing.replica_share_slack
        return None if slack is None or workers < 2 else share_cap(workers, slack)

    def _leave_home(self, workers: int) -> str:
        """When the prefix's learned home is given up (`home.HomeHints.leave`): LEAVE where it
        is a minor tenant of an overcommitted home; IF_BUSY where the shares are unknown, the
        prefix draws more than one worker carries, or at most half of its home's traffic (the
        home exists for its other tenants); STAY otherwise."""
        slack = self.routing.replica_share_slack
        if self.placement.home is None or self.placement.share is None or slack is None or workers < 2:
            return IF_BUSY
        homed = self.placement.homed_share.get(self.placement.home, 0.0)
        if minor_tenant(self.placement.share, homed, workers, slack):
            return LEAVE
        if copies_needed(self.placement.share, workers, slack) > 1 or 2 * self.placement.share <= homed:
            return IF_BUSY
        return STAY
