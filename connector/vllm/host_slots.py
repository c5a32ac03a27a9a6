"""A host-memory tier behind vLLM's KV cache: which host slot holds which of vLLM's block
hashes (pure: no vLLM import, no I/O). Least recently used first out.

Write-through: every full block vLLM computes is copied into a slot at the end of the step
that computed it, so a block the engine later evicts from its own cache is still here, and a
request whose prefix continues here past vLLM's own prefix-cache hit loads those blocks back
instead of computing them. A slot is rewritten only by a save at the end of a step, after
that step's loads (and every earlier step's) have read it: a load never reads a slot that a
later save took.

Caller: `connector.vllm.host_scheduler.HostScheduler`, on EngineCore's scheduler thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence


class HostSlots:
    def __init__(self, capacity: int) -> None:
        assert capacity > 0, "a host tier holds at least one block"
        self.capacity = capacity
        self._slots: OrderedDict[Hashable, int] = OrderedDict()  # block hash -> slot, least recent first
        self._free = list(range(capacity - 1, -1, -1))  # popped from the end: slot 0 first

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, block_hash: Hashable) -> bool:
        return block_hash in self._slots

    def run(self, block_hashes: Sequence[Hashable], start: int) -> int:
        """How many of `block_hashes[start:]`, from the first on, are held here."""
        count = 0
        for block_hash in block_hashes[start:]:
            if block_hash not in self._slots:
                break
            count += 1
        return count

    def take(self, block_hashes: Sequence[Hashable]) -> list[int]:
        """The slots of held blocks about to be loaded; they become the most recently used."""
        slots = []
        for block_hash in block_hashes:
            self._slots.move_to_end(block_hash)
            slots.append(self._slots[block_hash])
        return slots

    def store(self, block_hash: Hashable) -> tuple[int, Hashable | None] | None:
        """A slot for a block just computed, and the hash it held before (evicted; None: the
        slot was free); None if the block is held already (then it is the most recent)."""
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return None
        evicted: Hashable | None = None
        if self._free:
            slot = self._free.pop()
        else:
            evicted, slot = self._slots.popitem(last=False)
        self._slots[block_hash] = slot
        return slot, evicted
