"""The sim's second KV tier: host memory behind the engine's own KV blocks (pure, synchronous).

Caller: `block_manager.BlockManager`, which moves an announced block here when it evicts it
from the device tier (instead of forgetting it), takes it back when a request reuses it
(a load, cheaper than recomputing: the timing profile's `host_load_ms_per_token`), and drops
it for good when this tier is full and it is the least recently used. A hash is in one
tier at a time. Only a block's identity is kept (its hash, its parent's, its tokens): the
sim's KV bytes are a function of the tokens and the seed before them, so a loaded block is
written again from those.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HostBlock:
    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]
    adapter: str = ""  # the LoRA adapter of the sequence that computed it
    seed: int = 0  # the prefix hash before its first token (`kv_content`)
    cache_salt: str = ""  # a sequence's first block: its cache salt


class HostTier:
    def __init__(self, num_blocks: int) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self._blocks: OrderedDict[int, HostBlock] = OrderedDict()  # least recently stored first

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def __iter__(self) -> Iterator[HostBlock]:
        return iter(self._blocks.values())

    def put(self, block: HostBlock) -> list[int]:
        """Keep `block` (most recently used); the hashes dropped to make room, oldest first."""
        assert block.block_hash not in self._blocks, "a block is stored in the host tier once"
        self._blocks[block.block_hash] = block
        dropped: list[int] = []
        while len(self._blocks) > self.num_blocks:
            block_hash, _ = self._blocks.popitem(last=False)
            dropped.append(block_hash)
        return dropped

    def take(self, block_hash: int) -> HostBlock:
        """Remove a block the device tier takes back (loaded, or computed again)."""
        return self._blocks.pop(block_hash)

    def discard(self, block_hash: int) -> bool:
        return self._blocks.pop(block_hash, None) is not None

    def clear(self) -> None:
        self._blocks.clear()
