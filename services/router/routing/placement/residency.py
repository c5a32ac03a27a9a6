"""Which prefixes stay resident once the cluster's KV cannot hold them all. Pure.

Past the cluster's KV some prefixes miss wherever they go. The ones worth keeping cached on
their homes are the most requested of the recurring ones (at least `RESIDENT_COUNT` recent
requests: a prompt seen once claims no KV), as long as their prompts fit in
`RESIDENT_FILL` of the cluster's KV; the rest of it is for the others' misses, unique
prompts and decoding. A resident stays one until others draw `RESIDENT_HOLD` times its
requests: prefixes of close popularity would otherwise swap places at every ranking as
their counts wander, and each swap moves where one's misses and the other's KV are counted
(the one that falls out is evicted, the one that comes in computed again).

Caller: `resident_prefixes.ResidentPrefixes`, for `homes.PrefixHomes`, which keeps the live
prefixes and has them ranked again as traffic moves.
"""

from __future__ import annotations

from collections.abc import Container, Iterable

RESIDENT_COUNT = 1.5  # recent requests (decayed) that make a prefix recurring: a unique prompt claims no KV
RESIDENT_FILL = 0.75  # of the cluster's KV, what resident prefixes' prompts may keep once not all fit
RESIDENT_HOLD = 1.5  # a resident's recent requests count this many times over in the next ranking


def rank_residents(live: Iterable[tuple[int, str, float, int]], capacity_tokens: int,
                   incumbents: Container[int] = frozenset()) -> tuple[set[int], dict[str, int]]:
    """Of the `live` prefixes, as (key, home, recent requests, prompt tokens): the resident
    keys, most requested first into `RESIDENT_FILL` of `capacity_tokens` (one that does not
    fit is passed over for smaller ones; the `incumbents`, the residents so far, ranked by
    `RESIDENT_HOLD` times their requests), and per home the tokens of its residents."""
    budget = RESIDENT_FILL * capacity_tokens
    residents: set[int] = set()
    tokens: dict[str, int] = {}
    used = 0

    def rank(prefix: tuple[int, str, float, int]) -> float:
        return -prefix[2] * (RESIDENT_HOLD if prefix[0] in incumbents else 1.0)

    recurring = (prefix for prefix in live if prefix[2] >= RESIDENT_COUNT)
    for key, home, _, prompt_tokens in sorted(recurring, key=rank):
        if used + prompt_tokens <= budget:
            used += prompt_tokens
            residents.add(key)
            tokens[home] = tokens.get(home, 0) + prompt_tokens
    return residents, tokens
