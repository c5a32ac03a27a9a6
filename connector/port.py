"""The port an in-process engine implements for the KV data plane: `KvPort`, `LayerHook`.

The data plane owns this contract; engines implement it (the sim engine,
`services/worker/sim/engine.py`, through its `SimKvPort`). Its callers are the sim data
plane (`connector.sim.worker_kv.WorkerKv`), the holder (`connector.sim.holder.KvHolder`),
the reader (`connector.puller.KvPuller`) and push mode (`connector.push`). An engine whose
KV lives in other processes (vLLM) has its own, narrower port:
`connector.vllm.engine_port.VllmKvEngine`. Both describe their KV the same way: a
`connector.kv_geometry.KvShape`, where each block, layer and head lives, rank by rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np

    from connector.kv_checksums import Piece
    from connector.kv_geometry import KvShape

LayerHook = Callable[[int, list[int]], None]
"""`on_layer(layer, block_ids)`: layer `layer` of these blocks (full prompt blocks the request
computed in one engine step, in token order) is final. An engine that supports push mode
takes it as `generate(..., on_layer=hook)`. Called on the engine's event loop thread, in
layer order, before the step's outputs are delivered; it must not block (queue the work)
and must not raise (a raising hook fails its request)."""


class KvPort(Protocol):
    """What the KV data plane may ask of an engine. Implemented by `SimEngine`.

    Every method is synchronous, cheap, and must be called on the engine's event loop thread
    (transfers themselves run elsewhere and touch only the bytes of blocks pinned for them).

    Memory: `kv_shape()` says where each (block, layer, head) lives in each rank's region,
    `kv_regions()` are those regions (flat uint8, one per rank, in rank order), each
    registered with its own transport once. Every rank shares the engine's block ids.

    Pins: `pin_prefix`, `pin_blocks` and `allocate_for_transfer` each take one reference per
    block; a pinned block is never evicted or handed to another request, and its bytes are
    only written by whoever pinned it. Every pin is dropped with exactly one `unpin` per
    block id (a leak shows as the engine's used blocks staying above zero when idle).

    Hold (reader pulls from here): after a request's prefill, `pin_prefix(block_hashes)`
    pins the longest cached leading run of its chain; `block_checksums` vouches for them.
    Pin it right after receiving the request's first output, before the consumer's next
    await: the engine yields to the loop once after delivering a step's outputs and before
    the next step, which could evict the blocks.

    Pull (reading into here): `allocate_for_transfer(n)` -> read into the blocks ->
    `commit_transferred(...)` -> unpin the blocks that did not commit at once -> start the
    request and unpin the committed ones (they are cached now: admission takes its own
    references; keeping them pinned until then can deadlock a full pool of queued requests,
    while unpinned the worst case is an eviction and a recompute). Admission reuses every
    cached block of the prompt's chain, holes included, and computes only the rest.
    Unpinning wakes an engine that waits for free blocks.

    Push (writing from here): the engine's `generate(..., on_layer=hook)`; the hook gets
    each step's newly full prompt blocks layer by layer. Blocks the request reused from the
    cache are never reported: send those from `prompt_block_ids` (all layers) when prefill
    starts. The ids stay valid during the hook calls of that step, even if the request
    finishes in it; to read them afterwards, `pin_blocks` them in the hook for layer 0 and
    unpin after the last write. A preempted request computes its blocks again, into other
    blocks: the hook reports them again.
    """

    def kv_shape(self) -> KvShape: ...

    def kv_regions(self) -> list[np.ndarray]: ...

    def prompt_block_ids(self, request_id: str) -> list[int]:
        """The blocks of a live request's prompt allocated so far, in token order (reused and
        computed alike); empty once it finished, and while it waits."""
        ...

    def pin_prefix(self, block_hashes: list[int]) -> list[int]:
        """Pin the longest leading run of `block_hashes` cached here: its block ids."""
        ...

    def pin_blocks(self, block_ids: list[int]) -> None:
        """Pin blocks whatever their state, bytes untouched (a writer's source blocks)."""
        ...

    def allocate_for_transfer(self, num_blocks: int) -> list[int] | None:
        """`num_blocks` pinned, uncached blocks to receive KV into (cached blocks are evicted,
        least recently used first); None if the pool cannot spare them."""
        ...

    def commit_transferred(self, block_ids: list[int], first_block: int, token_ids: list[int], ok: list[bool], *,
                           adapter: str = "", cache_salt: str = "") -> list[bool]:
        """Register received blocks in the prefix cache, as if computed here.

        `block_ids[i]` received block `first_block + i` of the sequence `token_ids` (its whole
        prompt, or more) served with the LoRA `adapter` and `cache_salt` (its chain's root). A block is committed when `ok[i]`
        (its bytes arrived and matched the sender's checksums) and its bytes verify against
        its tokens. A block whose hash is already cached here counts as committed but stays
        private (the cached copy serves). Returns, per block, whether it committed. Pins are
        unchanged: unpin every block id later.
        """
        ...

    def unpin(self, block_ids: list[int]) -> None: ...

    def block_checksums(self, block_ids: list[int]) -> list[int]:
        """Whole blocks' checksums as a holder vouches for them (`connector.kv_checksums`):
        block by block, KV head by KV head."""
        ...

    def unit_checksums(self, units: list[list[Piece]]) -> list[int]:
        """Checksums of units made of pieces of blocks here, flat (unit by unit, head by head)."""
        ...
