"""Copies of a prefix served away from its home: what they add to each worker's recent
requests and KV. Pure.

A popular prefix is copied to other workers than its home (`PrefixHomes.record` with
`copy`); its home stays, and `PrefixHomes` keeps, per copied prefix, the decayed count of
the requests each worker served for it. `sum_copies` turns those counts into per-worker
sums once a step: few prefixes are copied (the popular ones), so the walk is short.

Caller: `homes.PrefixHomes`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

COPY_FORGOTTEN = 0.01  # a prefix's copies' requests (decayed) below which they are no longer counted


@dataclass(frozen=True, slots=True)
class CopySums:
    """Per worker, from the recent copies (`PrefixHomes._copies`): the requests it served for
    copies of prefixes homed elsewhere less those copies of its own prefixes served elsewhere
    (`requests`), and the prompt tokens of the live copies it holds (`tokens`)."""

    requests: dict[str, float]
    tokens: dict[str, int]


def sum_copies(copies: dict[int, dict[str, tuple[float, int]]],
               prefixes: Mapping[int, tuple[str, float, int, int, float]],
               keep: float, step: int, live_count: float) -> CopySums:
    """`CopySums` of `copies` (per prefix key, per worker: its served requests and the step
    they were counted at, decayed to `step` by `keep` a step, as `PrefixHomes` decays its
    counts), each prefix's home and prompt tokens read from its entry in `prefixes`; a copy
    holds the prompt's KV from `live_count` served requests. The prefixes whose copies have
    decayed away are dropped from `copies`. (Once a routed request: the decay is inline.)"""
    sums = CopySums({}, {})
    requests, held = sums.requests, sums.tokens
    for prefix_key in list(copies):
        home, _, _, tokens, _ = prefixes[prefix_key]
        served = [(worker_id, value * keep ** (step - at_step))
                  for worker_id, (value, at_step) in copies[prefix_key].items()]
        if sum(count for _, count in served) < COPY_FORGOTTEN:
            del copies[prefix_key]
            continue
        for worker_id, count in served:
            if worker_id != home:  # it became the prefix's home since: the count is there now
                requests[worker_id] = requests.get(worker_id, 0.0) + count
                requests[home] = requests.get(home, 0.0) - count
                if count >= live_count:
                    held[worker_id] = held.get(worker_id, 0) + tokens
    return sums
