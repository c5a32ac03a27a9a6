"""How much of a pull vLLM claims, and what the worker side reads for it, when the holder's
blocks and vLLM's differ in size (pure: no vLLM import).

vLLM loads external tokens right after the ones it has cached (`num_computed_tokens`, whole
blocks of its own) and computes at least one prompt token. A pull reads the holder's blocks
(the units) whole, verified against the holder's checksums, into vLLM's blocks allocated for
the claim. So the claim starts where a unit starts (else nothing is claimed) and ends where
the units read fit into vLLM's allocation: anywhere up to the usable end when the holder's
blocks are no larger than vLLM's (a partly claimed unit still lands inside the last
allocated block), at a unit's end otherwise (the holder's partial tail block is a unit
that ends at its last token).

Callers: `connector_scheduler.SchedulerSide` (`claim_end` in `get_num_new_matched_tokens`,
`load_plan` once vLLM allocated the blocks).
"""

from __future__ import annotations

from typing import NamedTuple

# A holder's partial tail block is checksummed and read up to the next multiple of this
# many tokens (no further than its block): attention kernels tile a block's tokens (vLLM's
# CPU AMX kernel by pairs), and ranges must fall on tiles.
TAIL_ALIGN = 16


def tail_read_tokens(tail_tokens: int, holder_block_size: int) -> int:
    """The tokens of a holder's partial tail block that are checksummed and read."""
    return min(-(-tail_tokens // TAIL_ALIGN) * TAIL_ALIGN, holder_block_size)


def claim_end(*, held_tokens: int, usable_tokens: int, computed_tokens: int, holder_block_size: int,
              block_size: int) -> int:
    """The token the load reaches (`computed_tokens`: nothing to load)."""
    if computed_tokens % holder_block_size or usable_tokens <= computed_tokens:
        return computed_tokens
    if holder_block_size <= block_size:
        return usable_tokens
    end = usable_tokens // holder_block_size * holder_block_size
    if held_tokens <= usable_tokens:  # the holder's last (partial) block is read whole
        end = held_tokens
    return max(end, computed_tokens)


class LoadPlan(NamedTuple):
    first_unit: int  # holder blocks before it are cached here (not read)
    units: int  # holder blocks read
    tokens: int  # tokens read, from the first unit's first on
    first_local: int  # vLLM's first block the load fills (index in the request's blocks)
    local_blocks: int  # vLLM's blocks it fills


def load_plan(*, computed_tokens: int, external_tokens: int, held_tokens: int, holder_block_size: int,
              block_size: int) -> LoadPlan:
    """What the worker side reads for a claim of `external_tokens` after `computed_tokens`."""
    end = computed_tokens + external_tokens
    first_unit = computed_tokens // holder_block_size
    units = -(-end // holder_block_size) - first_unit
    full, tail = divmod(held_tokens, holder_block_size)
    readable = full * holder_block_size + (tail_read_tokens(tail, holder_block_size) if tail else 0)
    tokens = min((first_unit + units) * holder_block_size, readable) - first_unit * holder_block_size
    first_local = computed_tokens // block_size
    return LoadPlan(first_unit=first_unit, units=units, tokens=max(tokens, 0), first_local=first_local,
                    local_blocks=-(-end // block_size) - first_local)
