"""vLLM's own block hashes by the short form its KV events carry, for pinning a prefix by
exactly the blocks a holder announced.

vLLM hashes a block from its tokens and its extra keys: the images in it (identifier and
offset), the LoRA adapter, the cache salt. A holder that pins a prefix by sending its tokens
alone (a control request has neither images nor adapter) gets other hashes for such blocks
and finds none of them cached: a prefix pull of a prompt with an image would always be
refused. KV events give each block's hash as its low 64 bits (vLLM's
`maybe_convert_block_hash`), which the holder's mirror keeps; this map turns them back into
vLLM's full hashes, learnt from the requests the scheduler side sees (their prompt blocks as
they arrive, every full block when they finish). It is bounded: the oldest entries go first,
and a hash it no longer knows pins nothing (the caller falls back to the tokens).

Pure: called on vLLM's engine thread by `connector_scheduler.SchedulerSide`, as is
`cached_run` (the longest cached run of some hashes, for its pins).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool

_LOW_64 = (1 << 64) - 1


def short_hash(block_hash: bytes) -> int:
    """vLLM's event form of a block hash (`maybe_convert_block_hash` with its default: ints)."""
    return int.from_bytes(block_hash, "big") & _LOW_64


class EngineBlockHashes:
    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError("the hash map's limit must be positive")
        self.limit = limit
        self._full: dict[int, bytes] = {}  # short -> full, oldest first

    def __len__(self) -> int:
        return len(self._full)

    def learn(self, block_hashes: Iterable[bytes]) -> None:
        """Remember these blocks' full hashes (a known one moves to the newest end)."""
        full = self._full
        for block_hash in block_hashes:
            short = short_hash(block_hash)
            full.pop(short, None)
            full[short] = block_hash
        if len(full) > self.limit:
            for short in list(full)[: len(full) - self.limit * 3 // 4]:  # shed a quarter at once, not one a call
                del full[short]

    def leading(self, short_hashes: Sequence[int]) -> list[bytes]:
        """The full hashes of the longest leading run of `short_hashes` known here."""
        return list(itertools.takewhile(_known, map(self._full.get, short_hashes)))


def _known(block_hash: bytes | None) -> bool:
    return block_hash is not None


def cached_run(pool: BlockPool, block_hashes: list) -> list[int]:
    """The block ids of the longest leading run of `block_hashes` cached in `pool`."""
    found: list[int] = []
    for block_hash in block_hashes:
        cached = pool.get_cached_block(block_hash, [0])
        if cached is None:
            break
        found.append(cached[0].block_id)
    return found
