"""How much of a pull vLLM claims, and what the worker side reads for it, when the holder's
blocks and vLLM's differ in size (pure: no vLLM import).

vLLM loads external tokens right after the ones it has cached (`num_computed_tokens`, whole
blocks of its own) and computes at least one prompt token. A pull reads the holder's blocks
(the units) whole, verified against the holder's checksums (a partial tail block too, as
its holder checksummed it: whole-block ranges stay few and large, whatever tiles the
attention kernel keeps), into vLLM's blocks allocated for the claim. So the claim starts
where a unit starts (else nothing is claimed) and ends where the units read fit into vLLM's
allocation: anywhere up to the usable end when the holder's blocks are no larger than
vLLM's (a partly claimed unit still lands inside the last allocated block), at the end of
the last full unit before it otherwise (the tail's tokens are then computed here).

Callers: `connector_scheduler.SchedulerSide` (`claim_end` in `get_num_new_matched_tokens`,
`load_plan` once vLLM allocated the blocks).
"""

from __future__ import annotations

from typing import NamedTuple


def claim_end(*, usable_tokens: int, computed_tokens: int, holder_block_size: int,
              block_size: int) -> int:
    """The token the load reaches (`computed_tokens`: nothing to load)."""
    if computed_tokens % holder_block_size or usable_tokens <= computed_tokens:
        return computed_tokens
    if holder_block_size <= block_size:
        return usable_tokens
    return max(usable_tokens // holder_block_size * holder_block_size, computed_tokens)


class LoadPlan(NamedTuple):
    first_unit: int  # holder blocks before it are cached here (not read)
    units: int  # holder blocks read
    tokens: int  # tokens read, from the first unit's first on (whole units)
    first_local: int  # vLLM's first block the load fills (index in the request's blocks)
    local_blocks: int  # vLLM's blocks it fills


def load_plan(*, computed_tokens: int, external_tokens: int, holder_block_size: int,
              block_size: int) -> LoadPlan:
    """What the worker side reads for a claim of `external_tokens` after `computed_tokens`."""
    end = computed_tokens + external_tokens
    first_unit = computed_tokens // holder_block_size
    units = -(-end // holder_block_size) - first_unit
    first_local = computed_tokens // block_size
    return LoadPlan(first_unit=first_unit, units=units, tokens=units * holder_block_size, first_local=first_local,
                    local_blocks=-(-end // block_size) - first_local)
