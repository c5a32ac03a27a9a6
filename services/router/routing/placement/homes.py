"""Prefix homes: where each prefix was last served, and how much recent traffic each worker's
prefixes bring. Pure.

Under KV pressure every cache is full and prefixes are evicted all the time, so a prompt
often arrives that no worker holds (or holds only the start of). Sent wherever the load is
lowest at that instant, such prompts land on a different worker each time: every worker
then sees more tenants than its cache holds, and a burst of newcomers on one worker evicts
even its busiest tenant. Sent back to the worker that served their prefix last (the
prefix's *home*), the tenants stay partitioned: each worker's cache churns only among its
own, and a popular prefix is evicted only by its own neighbours.

A prefix seen for the first time (or whose home is busy) needs a new home. To keep the
partition balanced by traffic, not by count, each prefix carries its share of the recent
requests (a count that decays by `1 - 1/horizon` per routed request: scale-free, no
timescale) and each worker the summed shares of the prefixes homed there; the new home is
the worker with the smallest such sum among the near-cheapest (see
`rules.HomeRules.home`). A request served by a copy of a popular prefix (on
another worker than its home) counts where it was served in those sums (`homed_share`),
though the prefix keeps its home: the copy's worker carries that traffic, and counted at
the home it would make the home look overcommitted and the copy's worker light. Past the
cluster's KV (`limited`, below) they count at the home: counted where served there, the
sim sweep's overfull point cached less (0.68 to 0.75 of the prompt tokens over 3 runs,
against 0.73 to 0.76) and its P90 rose (586 to 1163 ms, against 570 to 706).

Each worker also keeps the prompt tokens of its live homed prefixes (`homed_tokens`; where
not `limited`, also of the live copies it holds): when they exceed its KV pool, its tenants
evict one another there, and a minor one is better moved than left to thrash. The sums
are kept as prefixes are routed: each live prefix has the step at which its decayed count
falls below `LIVE_COUNT` in a heap, popped as steps pass, so asking costs no walk over the
prefixes (there may be tens of thousands; the copies, a few popular prefixes, are summed
once a step).

When the live prefixes need more KV than the whole cluster holds (`limited`), some of them
miss wherever they go, and counting them in `homed_tokens` would make every worker look
overfull (so every minor tenant would look worth moving, and no worker would look roomy for
a new home). So only the *resident* prefixes count there (`residency.rank_residents`: the
most requested recurring ones that fit in part of the cluster's KV), ranked anew every
`RESIDENCY_EVERY` routed requests (`resident_prefixes`); the others are *transient*
(`resident` is False for them; `transient` is True for the recurring ones). They miss
wherever they go, so it is their load, not their KV, that their homes must share out. A
miss costs several hits (a whole prompt against its unshared tail), so that load is counted
as *work*: each request adds the prompt tokens its worker is predicted to compute plus
`overhead_tokens` (its engine steps' fixed cost, `RoutingConfig.request_overhead_tokens`),
decayed as the counts are, and `work_shares` gives each worker's part of the recent work of
its homed prefixes, resident or not. A cold cluster, whose prefixes have all been seen
once, has no residents yet: none overflows a worker, so none is moved on shares that one
request each cannot tell apart. Where the live prefixes all fit, or no worker's KV pool is
known, every live prefix counts.

Caller: `placement.Placement`, which records each routed prompt here and reads it into the
snapshot a routing request carries (`snapshot.PrefixPlacement`).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Iterator, Mapping

from services.router.routing.placement.copies import CopySums, sum_copies
from services.router.routing.placement.residency import RESIDENT_COUNT
from services.router.routing.placement.resident_prefixes import ResidentPrefixes

DEFAULT_HORIZON = 512  # routed requests over which a prefix's share decays by 1/e
MAX_TRACKED = 65_536  # prefixes remembered; the least recently routed beyond are forgotten
LIVE_COUNT = 0.5  # a prefix with fewer recent requests (decayed) keeps no KV on its home in `homed_tokens`
# a request's work beyond the prompt tokens it computes (its engine steps' fixed cost), in prompt
# tokens: a 1088-token miss then weighs 6.2 hits of 64 computed tokens
DEFAULT_OVERHEAD_TOKENS = 128.0


class PrefixHomes:
    """Per prefix key, its home worker and decayed request count; per worker, their sum."""

    def __init__(self, horizon: int = DEFAULT_HORIZON, max_tracked: int = MAX_TRACKED,
                 overhead_tokens: float = DEFAULT_OVERHEAD_TOKENS) -> None:
        if horizon < 1 or max_tracked < 1:
            raise ValueError("horizon and max_tracked must be at least 1")
        if overhead_tokens < 0:
            raise ValueError("overhead_tokens must not be negative")
        self.overhead_tokens = overhead_tokens
        self._keep = 1.0 - 1.0 / horizon  # per routed request
        self._max_tracked = max_tracked
        self._step = 0
        self.changes = 0  # records, forgets and capacities so far: a snapshot is of one count
        # key -> home, count, at step, its prompt's tokens (the KV it keeps on its home), and its
        # work (decayed as the count)
        self._prefixes: OrderedDict[int, tuple[str, float, int, int, float]] = OrderedDict()
        self._workers: dict[str, tuple[float, int]] = {}  # worker -> summed counts, at step
        self._work: dict[str, tuple[float, int]] = {}  # worker -> summed work, at step
        self._members: dict[str, set[int]] = {}  # worker -> the prefix keys homed there
        self._total = (0.0, 0)  # every tracked prefix's summed count, at step
        self._live_tokens: dict[str, int] = {}  # worker -> the tokens of its live homed prefixes
        self._deaths: list[tuple[int, int, int]] = []  # heap: (step it stops being live, key, its at_step)
        self._live: set[int] = set()  # the live prefixes' keys
        self._residency = ResidentPrefixes()  # the pools, and which live prefixes are resident
        # prefix key -> worker -> its requests served by a copy on that worker (not its home),
        # decayed as the counts, at step: only for prefixes copied recently (a few popular ones)
        self._copies: dict[int, dict[str, tuple[float, int]]] = {}
        self._copied_at: tuple[int, CopySums] | None = None  # `_copy_sums()` as of a step

    def _now(self, value: float, at_step: int) -> float:
        return value * self._keep ** (self._step - at_step)

    def _death(self, count: float, at_step: int) -> int:
        """The first step at which `count` (as of `at_step`) has decayed below `LIVE_COUNT`."""
        if count < LIVE_COUNT:
            return at_step
        if self._keep <= 0.0:
            return at_step + 1
        step = at_step + int(math.log(LIVE_COUNT / count) / math.log(self._keep))
        while step > at_step and count * self._keep ** (step - 1 - at_step) < LIVE_COUNT:
            step -= 1
        while count * self._keep ** (step - at_step) >= LIVE_COUNT:
            step += 1
        return step

    def _bury(self) -> None:
        """Take the prefixes whose counts have decayed below `LIVE_COUNT` out of the live sums."""
        deaths = self._deaths
        while deaths and deaths[0][0] <= self._step:
            _, key, at_step = heapq.heappop(deaths)
            entry = self._prefixes.get(key)
            if entry is not None and entry[2] == at_step:  # else routed again (or forgotten) since
                self._live_tokens[entry[0]] -= entry[3]
                self._live.discard(key)
                self._residency.drop(key, entry[0], entry[3])

    def _unlive(self, key: int, entry: tuple[str, float, int, int, float]) -> None:
        """A tracked entry is replaced or dropped: out of its home's live sum if still live."""
        if self._death(entry[1], entry[2]) > self._step:
            self._live_tokens[entry[0]] -= entry[3]
            self._live.discard(key)
        self._residency.drop(key, entry[0], entry[3])

    def home(self, prefix_key: int) -> str | None:
        entry = self._prefixes.get(prefix_key)
        return entry[0] if entry is not None else None

    def share(self, prefix_key: int) -> float:
        """The prefix's share of the recent requests (0.0 when not tracked): how much of the
        cluster's traffic one copy of it draws."""
        entry = self._prefixes.get(prefix_key)
        total = self._now(*self._total)
        return min(1.0, self._now(entry[1], entry[2]) / total) if entry is not None and total > 0 else 0.0

    def record(self, prefix_key: int, worker_id: str, tokens: int = 0, *, computed: int = 0,
               copy: bool = False) -> None:
        """A prompt of `tokens` with this prefix, `computed` of them predicted uncached there,
        was routed to `worker_id`: its home now, one more request. With `copy` (`worker_id` was
        sent a copy of a prefix its home still holds), the prefix's home stays, and the request
        counts where it was served (`homed_share`)."""
        self._step += 1
        self.changes += 1
        self._bury()
        count = work = 0.0
        entry = self._prefixes.pop(prefix_key, None)
        resident = self._residency.holds(prefix_key)
        if entry is not None and copy:
            if worker_id != entry[0]:
                served = self._copies.setdefault(prefix_key, {})
                served[worker_id] = (self._now(*served.get(worker_id, (0.0, self._step))) + 1.0, self._step)
            worker_id = entry[0]
        if entry is not None:
            self._unlive(prefix_key, entry)
            count, work = self._now(entry[1], entry[2]), self._now(entry[4], entry[2])
            self._add(entry[0], -count, -work)
            self._unhome(entry[0], prefix_key)
        count += 1.0
        work += computed + self.overhead_tokens
        self._prefixes[prefix_key] = (worker_id, count, self._step, tokens, work)
        self._add(worker_id, count, work)
        self._members.setdefault(worker_id, set()).add(prefix_key)
        death = self._death(count, self._step)
        if death > self._step:
            self._live_tokens[worker_id] = self._live_tokens.get(worker_id, 0) + tokens
            self._live.add(prefix_key)
            heapq.heappush(self._deaths, (death, prefix_key, self._step))
            if resident:  # it stays resident, at its (new) home, until the next ranking
                self._residency.keep(prefix_key, worker_id, tokens)
        self._total = (self._now(*self._total) + 1.0, self._step)
        if len(self._prefixes) > self._max_tracked:
            old_key, old_entry = self._prefixes.popitem(last=False)
            old_home, old_count, at_step, _, old_work = old_entry
            self._unlive(old_key, old_entry)
            self._add(old_home, -self._now(old_count, at_step), -self._now(old_work, at_step))
            self._unhome(old_home, old_key)
            self._copies.pop(old_key, None)
            self._total = (max(0.0, self._now(*self._total) - self._now(old_count, at_step)), self._step)

    def _copy_sums(self) -> CopySums:
        """`CopySums` as of this step (prefixes whose copies have decayed away are dropped)."""
        if self._copied_at is not None and self._copied_at[0] == self._step:
            return self._copied_at[1]
        sums = sum_copies(self._copies, self._prefixes, self._keep, self._step, LIVE_COUNT)
        self._copied_at = (self._step, sums)
        return sums

    def _copies_counted(self) -> dict[str, float]:
        """Where copies count where they were served (the cluster is not `limited`): per worker,
        the recent requests it served for copies of prefixes homed elsewhere, less those that
        copies of its homed prefixes served elsewhere (`CopySums.requests`); else none."""
        return self._copy_sums().requests if self._rank() is None else {}

    def _carried(self, worker_id: str, copied: Mapping[str, float]) -> float:
        """The recent requests `worker_id` carried for its homed prefixes and for copies."""
        homed = self._workers.get(worker_id)
        return max(0.0, (self._now(*homed) if homed is not None else 0.0) + copied.get(worker_id, 0.0))

    def _unhome(self, worker_id: str, prefix_key: int) -> None:
        """The prefix is no longer homed on `worker_id`; a worker left with none has no count
        or work (not the rounding residue of taking theirs out)."""
        members = self._members[worker_id]
        members.discard(prefix_key)
        if not members:
            self._workers[worker_id] = self._work[worker_id] = (0.0, self._step)

    def _add(self, worker_id: str, count: float, work: float) -> None:
        total, at_step = self._workers.get(worker_id, (0.0, self._step))
        self._workers[worker_id] = (max(0.0, self._now(total, at_step) + count), self._step)
        total, at_step = self._work.get(worker_id, (0.0, self._step))
        self._work[worker_id] = (max(0.0, self._now(total, at_step) + work), self._step)

    def forget(self, worker_id: str) -> None:
        """A worker left: its prefixes have no home until routed again."""
        self.changes += 1
        self._workers.pop(worker_id, None)
        self._work.pop(worker_id, None)
        for served in self._copies.values():
            served.pop(worker_id, None)
        self._copied_at = None
        self._live_tokens.pop(worker_id, None)  # its entries' heap items find them gone
        self._residency.forget(worker_id)
        for prefix_key in self._members.pop(worker_id, set()):
            self._live.discard(prefix_key)
            _, count, at_step, _, _ = self._prefixes.pop(prefix_key)
            self._copies.pop(prefix_key, None)
            self._total = (max(0.0, self._now(*self._total) - self._now(count, at_step)), self._step)

    def homed_share(self) -> dict[str, float]:
        """Per worker, the share of recent requests it carried: those of the prefixes homed
        there, a copy's counted where it was served unless `limited` (over every tracked
        prefix's count, as `worker_share`: the sum of the workers' counts may differ from it
        by rounding, and a lone worker left with a rounding residue then has none)."""
        total = self._now(*self._total)
        if total <= 0:
            return {}
        copied = self._copies_counted()
        return {worker_id: min(1.0, self._carried(worker_id, copied) / total)
                for worker_id in {*self._workers, *copied}}

    def worker_share(self, worker_id: str) -> float:
        """`homed_share()[worker_id]` without computing every worker's (KeyError for a worker
        with no homed prefixes or copies on record, or with nothing tracked): the worker's
        carried count over every tracked prefix's, which is the sum of the workers' counts up
        to rounding."""
        total, copied = self._now(*self._total), self._copies_counted()
        if (worker_id not in self._workers and worker_id not in copied) or total <= 0:
            raise KeyError(worker_id)
        return min(1.0, self._carried(worker_id, copied) / total)

    def homed_workers(self) -> list[str]:
        return [worker_id for worker_id, keys in self._members.items() if keys]

    def set_capacity(self, worker_id: str, kv_tokens: int) -> None:
        """`worker_id`'s KV pool holds `kv_tokens` (0: unknown)."""
        self.changes += 1
        self._residency.set_capacity(worker_id, kv_tokens)

    def _rank(self) -> set[int] | None:
        """The resident prefixes, or None where every live one counts (not `limited`), ranked
        anew when `RESIDENCY_EVERY` requests have been routed since the last ranking
        (`ResidentPrefixes.rank`: the prefixes no longer live are buried first)."""
        self._bury()
        return self._residency.rank(self._step, self._live_tokens, self._live_prefixes)

    def _live_prefixes(self) -> Iterator[tuple[int, str, float, int]]:
        """The live prefixes as (key, home, recent requests, prompt tokens), to rank."""
        prefixes = self._prefixes
        return ((key, prefixes[key][0], self._now(prefixes[key][1], prefixes[key][2]), prefixes[key][3])
                for key in self._live)

    def limited(self) -> bool:
        """Whether the live prefixes need more KV than the cluster holds, so only some of them
        are resident."""
        return self._rank() is not None

    def resident(self, prefix_key: int) -> bool:
        """Whether the prefix is among the resident ones (its KV is worth keeping on its home);
        every live one is where not `limited`."""
        residents = self._rank()
        return prefix_key in self._live if residents is None else prefix_key in residents

    def transient(self, prefix_key: int) -> bool:
        """Whether the prefix is a recurring one (at least `RESIDENT_COUNT` recent requests)
        that is not resident, where the cluster is `limited`: it misses wherever it goes."""
        residents = self._rank()
        if residents is None or prefix_key in residents or prefix_key not in self._live:
            return False
        _, count, at_step, _, _ = self._prefixes[prefix_key]
        return self._now(count, at_step) >= RESIDENT_COUNT

    def work_shares(self) -> dict[str, float]:
        """Per worker, its homed prefixes' share of the recent work (each request: the prompt
        tokens computed, plus `overhead_tokens`); empty with no work on record."""
        work = {worker_id: self._now(*entry) for worker_id, entry in self._work.items()}
        total = sum(work.values())
        return {worker_id: value / total for worker_id, value in work.items()} if total > 0 else {}

    def work_share(self, prefix_key: int) -> float | None:
        """The prefix's share of the recent work (None: not tracked, or no work on record)."""
        entry = self._prefixes.get(prefix_key)
        total = sum(self._now(*work) for work in self._work.values())
        return min(1.0, self._now(entry[4], entry[2]) / total) if entry is not None and total > 0 else None

    def homed_tokens(self, worker_id: str, *, resident: bool = True) -> int:
        """The KV the resident prefixes homed on `worker_id` keep there: the tokens of the last
        prompt of each. Without `resident`, or where not `limited`: of every live prefix (at
        least `LIVE_COUNT` recent requests, decayed); where not `limited`, also of each prefix
        homed elsewhere that `worker_id` holds as a live copy (it served at least `LIVE_COUNT`
        of its recent requests): that KV is held there, and a home chosen as if it were free
        would overfill the worker's cache (as the requests, copies count where they are
        served)."""
        limited = self._rank() is not None
        if resident and limited:
            return self._residency.tokens.get(worker_id, 0)
        self._bury()
        homed = self._live_tokens.get(worker_id, 0)
        return homed if limited else homed + self._copy_sums().tokens.get(worker_id, 0)

    def token_workers(self) -> list[str]:
        """The workers `homed_tokens` may count tokens on: those with homed prefixes or copies."""
        copies = [] if self._rank() is not None else self._copy_sums().tokens
        return list({*self.homed_workers(), *copies})
