"""Whether a worker's blocks are closed under "parent of", and `match` by bisection when they are.

A Tandem hash covers its whole prefix, so along a request's chain block i's parent is block
i - 1. If every block a worker holds (really or speculatively) has its parent held too (the
worker is *closed*), its bit in `KvIndex._holders` is monotone along any chain: held up to
some position, never after. `match` then needs only O(log n) lookups per point where a worker
drops out (`index_match.drop_points`), not one per block.

`Runs` keeps, per worker, what it takes to know whether a dropped block was a leaf (the only
drop that keeps a worker closed, and the one engines make: they evict from the tail):
- real blocks as the runs they were stored in (one `BlockStored`: a chain under one parent),
  indexed by each run's current tail; a block leaves a run only from its tail. A run keeps
  the event's own list of Tandem hashes (no copy) and how many of them are still held;
- `kids`: per block, how many runs and speculative blocks of the worker hang under it;
- `spec_parent`: each speculative block's parent (the block before it in the predicted chain,
  None for the chain's first block, which is the root: predictions are requests' chains).
Work is per event, not per block, on the store path (two dict writes). A drop
that is not a leaf, a store under a parent the worker does not hold, or anything that makes
blocks ambiguous (two engine hashes of one block) *opens* the worker: `match` scans any chain
whose first block it holds linearly, until a clear or a snapshot rebuilds its runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence


class OpenMask:
    """The bits of the index's open workers, kept by their `Runs` as they open and close."""

    __slots__ = ("mask",)

    def __init__(self) -> None:
        self.mask = 0


class Runs:
    __slots__ = ("enabled", "closed", "tails", "kids", "spec_parent", "bit", "open_mask")

    def __init__(self, enabled: bool, bit: int, open_mask: OpenMask) -> None:
        self.enabled = enabled  # off: always open, nothing kept
        self.closed = enabled
        self.bit = bit
        self.open_mask = open_mask
        self.tails: dict[int, list] = {}  # run tail -> [parent (None: root), chain, length held]
        self.kids: dict[int, int] = {}
        self.spec_parent: dict[int, int | None] = {}  # kept when open too: a reset needs it

    def open(self) -> None:
        if self.closed:
            self.open_mask.mask |= self.bit
        self.closed = False
        self.tails = {}
        self.kids = {}

    def stored(self, parent: int | None, blocks: list[int]) -> None:
        """The worker stored `blocks` (new to it), a chain under `parent` (None: the root).
        The list is kept, never changed: the caller must not change it either."""
        if not self.closed or not blocks:
            return
        self.tails[blocks[-1]] = [parent, blocks, len(blocks)]
        if parent is not None:
            kids = self.kids
            kids[parent] = kids.get(parent, 0) + 1

    def dropped_real(self, blocks: list[int]) -> None:
        """The worker no longer holds these real blocks (one event's, in its order): each must
        be a leaf once the others are gone, else the worker opens."""
        if not self.closed:
            return
        tails = self.tails
        kids = self.kids  # never holds a zero
        if len(blocks) == 1:  # engines often evict one block an event
            block = blocks[0]
            run = tails.get(block)
            if run is None or block in kids:
                self.open()
            else:
                self._pop_tail(block, run)
            return
        if self._dropped_tail_segment(blocks):
            return
        pending = blocks
        while pending and self.closed:
            left = []
            for block in pending:
                run = tails.get(block)
                if run is None or block in kids:
                    left.append(block)  # not a tail, or has kids: maybe once the others are gone
                else:
                    self._pop_tail(block, run)
            if len(left) == len(pending):
                self.open()
                return
            pending = left[::-1]  # a parent listed before its child: retried after it

    def _pop_tail(self, block: int, run: list) -> None:
        """Drop `block`, the tail of `run`: the run ends one block earlier, or is gone."""
        del self.tails[block]
        length = run[2] - 1
        if length:
            run[2] = length
            self.tails[run[1][length - 1]] = run
        else:
            self._unhang(run[0])

    def _dropped_tail_segment(self, blocks: list[int]) -> bool:
        """The common eviction, at C speed: `blocks` is the tail of one run, tail first, and
        nothing else hangs under them. Whether it was (and is now dropped)."""
        run = self.tails.get(blocks[0])
        if run is None or len(blocks) > run[2]:
            return False
        length = run[2] - len(blocks)
        segment = run[1][length:run[2]]
        segment.reverse()
        if segment != blocks or not self.kids.keys().isdisjoint(blocks):
            return False
        del self.tails[blocks[0]]
        if length:
            run[2] = length
            self.tails[run[1][length - 1]] = run
        else:
            self._unhang(run[0])
        return True

    def _unhang(self, parent: int | None) -> None:
        if parent is None:
            return
        kids = self.kids
        count = kids[parent] - 1
        if count:
            kids[parent] = count
        else:
            del kids[parent]

    def speculated(self, chain: Sequence[int], added: Iterable[int]) -> None:
        """Positions of `chain` that became speculative blocks of the worker."""
        if not self.enabled:
            return
        spec_parent = self.spec_parent
        kids = self.kids
        closed = self.closed
        for position in added:
            parent = chain[position - 1] if position else None
            spec_parent[chain[position]] = parent
            if closed and parent is not None:
                kids[parent] = kids.get(parent, 0) + 1

    def unspeculated(self, block: int) -> None:
        """A speculative block became real (it stays held) or went (see `dropped_speculative`)."""
        if not self.enabled:
            return
        parent = self.spec_parent.pop(block)
        if self.closed:
            self._unhang(parent)

    def dropped_speculative(self, blocks: list[int]) -> None:
        for block in blocks:
            self.unspeculated(block)
        if self.closed and any(map(self.kids.__contains__, blocks)):
            self.open()

    def reset(self, held: Callable[[int], bool]) -> None:
        """After a clear or a snapshot: no real runs yet; closed if every speculative block's
        parent is held (`held`); the caller then replays the snapshot's runs with `stored`."""
        self.closed = self.enabled
        self.tails = {}
        kids: dict[int, int] = {}
        for parent in self.spec_parent.values():
            if parent is not None:
                kids[parent] = kids.get(parent, 0) + 1
                if self.closed and not held(parent):
                    self.closed = False
        self.kids = kids if self.closed else {}
        if self.closed:
            self.open_mask.mask &= ~self.bit
        elif self.enabled:
            self.open_mask.mask |= self.bit

    def rebuild(self, parents: list[int | None], chain_runs: list[list[int]], tandem_of: dict[int, int],
                held: Callable[[int], bool], ambiguous: bool) -> None:
        """After a snapshot: its events' chains, each under its parent (an engine hash, None: the root)."""
        self.reset(held)
        if ambiguous:
            self.open()  # two engine hashes of one block: which run it leaves by cannot be told
        for parent, chain in zip(parents, chain_runs):
            if not self.closed:
                return
            if parent is None:
                self.stored(None, chain)
            elif parent in tandem_of:
                self.stored(tandem_of[parent], chain)
            else:
                self.open()  # its parent was evicted: the chain hangs under nothing the worker holds
