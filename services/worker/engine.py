"""The engine contract every engine implementation (sim, vLLM) fulfils.

The worker service is the only caller. It calls `generate()` once per request and
iterates the outputs; closing the iterator early (client gone) aborts the request and
frees its blocks. `take_kv_events()` drains the KV events buffered since the last call;
the worker publishes them. `load()` is a cheap snapshot, polled periodically.

Expected failures are values or typed errors: a prompt longer than the context raises
`shared.errors.InvalidArgument` before any work is queued.

`KvPort` is the second face of an engine, the one the KV data plane (connector/) uses:
the pool's memory, pinning blocks for a reader, receiving blocks from a writer, and a
per-layer hook for push mode. See its docstring for the rules a caller must follow.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import msgspec

from shared.compat import KvLayout
from shared.errors import InvalidArgument
from shared.schemas.generate import FinishReason, SamplingParams
from shared.schemas.kv_events import BlockStored, KvEvent

if TYPE_CHECKING:
    import numpy as np


class EngineInfo(msgspec.Struct, frozen=True, kw_only=True):
    engine: str  # "sim" | "vllm"
    model: str  # served model name
    layout: KvLayout
    kv_blocks: int
    max_num_seqs: int
    max_model_len: int
    vocab_size: int

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def compat_hash(self) -> str:
        return self.layout.compat_hash()


class EngineOutput(msgspec.Struct, kw_only=True):
    token_ids: list[int]  # tokens new since the previous output
    finish_reason: FinishReason | None = None  # set on the last output only
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    completion_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineLoad(msgspec.Struct, kw_only=True):
    running: int
    waiting: int
    kv_total_blocks: int
    kv_used_blocks: int
    kv_cached_blocks: int
    prompt_tokens_total: int
    cached_tokens_total: int
    generated_tokens_total: int
    pending_prefill_tokens: int
    # Prefill tokens actually computed (reused or received KV excluded; recomputation after
    # a preemption counts again): what a partial transfer costs shows here.
    computed_prompt_tokens_total: int = 0
    # Prompt tokens the engine itself counts as received over a KV connector (vLLM's
    # prompt-token sources); engines without such a count leave it 0.
    external_prompt_tokens_total: int = 0


def check_request(token_ids: list[int], sampling: SamplingParams, *, vocab_size: int, max_model_len: int) -> None:
    """The limits every engine applies before queueing anything, so all engines refuse the
    same requests with the same `InvalidArgument` messages."""
    if not token_ids:
        raise InvalidArgument("the prompt is empty")
    if sampling.max_tokens < 1:
        raise InvalidArgument(f"max_tokens must be at least 1, got {sampling.max_tokens}")
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:
        raise InvalidArgument(f"token ids must lie in [0, {vocab_size})")
    prompt_len = len(token_ids)
    if prompt_len > max_model_len:
        raise InvalidArgument(f"the prompt has {prompt_len} tokens, more than the maximum context "
                              f"length of {max_model_len}")
    if prompt_len + sampling.max_tokens > max_model_len:
        raise InvalidArgument(f"the prompt ({prompt_len} tokens) plus max_tokens ({sampling.max_tokens}) "
                              f"exceeds the maximum context length of {max_model_len}")


class Engine(Protocol):
    @property
    def info(self) -> EngineInfo: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def generate(self, request_id: str, token_ids: list[int], sampling: SamplingParams) -> AsyncIterator[EngineOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def load(self) -> EngineLoad: ...

    def take_kv_events(self) -> list[KvEvent]: ...

    def kv_snapshot(self) -> list[BlockStored]: ...


# ---- the KV data plane's port -------------------------------------------------------------

LayerHook = Callable[[int, list[int]], None]
"""`on_layer(layer, block_ids)`: layer `layer` of these blocks (full prompt blocks the request
computed in one engine step, in token order) is final. Called on the engine's event loop
thread, in layer order, before the step's outputs are delivered; it must not block (queue
the work) and must not raise (a raising hook fails its request)."""


@dataclass(frozen=True, slots=True)
class KvRegion:
    """The engine's KV pool as one region of memory, to register with NIXL once.

    Block `b` is `buffer[b * block_nbytes:(b + 1) * block_nbytes]`; layer `l` of block `b`
    starts `l * layer_nbytes` into it and is contiguous (push mode sends one layer at a time).
    Consecutive block ids are adjacent, so runs of blocks move as one descriptor.
    """

    buffer: np.ndarray  # uint8, flat, C-contiguous: the whole pool
    block_nbytes: int
    num_blocks: int
    num_layers: int
    layer_nbytes: int
    block_size: int  # tokens per block


class KvPort(Protocol):
    """What the KV connector may ask of an engine. Implemented by `SimEngine`.

    Every method is synchronous, cheap, and must be called on the engine's event loop thread
    (transfers themselves run elsewhere and touch only the bytes of blocks pinned for them).

    Pins: `pin_prefix`, `pin_blocks` and `allocate_for_transfer` each take one reference per
    block; a pinned block is never evicted or handed to another request, and its bytes are
    only written by whoever pinned it. Every pin is dropped with exactly one `unpin` per
    block id (a leak shows as `load().kv_used_blocks` staying above zero when idle).

    Hold (reader pulls from here): after a request's prefill, `pin_prefix(block_hashes)`
    pins the longest cached leading run of its chain, with checksums for the handle. Pin it
    right after receiving the request's first output, before the consumer's next await:
    the engine yields to the loop once after delivering a step's outputs and before the
    next step, which could evict the blocks.

    Pull (reading into here): `allocate_for_transfer(n)` -> read into the blocks ->
    `commit_transferred(...)` -> unpin the blocks that did not commit at once -> start the
    request with `generate()` and unpin the committed ones (they are cached now: admission
    takes its own references; keeping them pinned until then can deadlock a full pool of
    queued requests, while unpinned the worst case is an eviction and a recompute).
    Admission reuses every cached block of the prompt's chain, holes included, and computes
    only the rest. Unpinning wakes an engine that waits for free blocks.

    Push (writing from here): `generate(..., on_layer=hook)`; the hook gets each step's
    newly full prompt blocks layer by layer. Blocks the request reused from the cache are
    never reported: send those from `prompt_block_ids` (all layers) when prefill starts.
    The ids stay valid during the hook calls of that step, even if the request finishes in
    it; to read them afterwards, `pin_blocks` them in the hook for layer 0 and unpin after
    the last write. A preempted request computes its blocks again, into other blocks: the
    hook reports them again.
    """

    def kv_region(self) -> KvRegion: ...

    def generate(self, request_id: str, token_ids: list[int], sampling: SamplingParams, *,
                 on_layer: LayerHook | None = None) -> AsyncIterator[EngineOutput]: ...

    def prompt_block_ids(self, request_id: str) -> list[int]:
        """The blocks of a live request's prompt allocated so far, in token order (reused and
        computed alike); empty once it finished, and while it waits."""
        ...

    def pin_prefix(self, block_hashes: list[int]) -> list[tuple[int, int]]:
        """Pin the longest leading run of `block_hashes` cached here: [(block_id, checksum)]."""
        ...

    def pin_blocks(self, block_ids: list[int]) -> None:
        """Pin blocks whatever their state, bytes untouched (a writer's source blocks)."""
        ...

    def allocate_for_transfer(self, num_blocks: int) -> list[int] | None:
        """`num_blocks` pinned, uncached blocks to receive KV into (cached blocks are evicted,
        least recently used first); None if the pool cannot spare them."""
        ...

    def commit_transferred(self, block_ids: list[int], block_hashes: list[int], token_ids: list[int],
                           parent_hash: int | None, ok: list[bool]) -> list[bool]:
        """Register received blocks in the prefix cache, as if computed here.

        `block_ids[i]` received the block whose chain hash is `block_hashes[i]`; `token_ids`
        are their tokens (block_size each), `parent_hash` the hash of the block before the
        first (None at the sequence start). A block is committed when `ok[i]` (its bytes
        arrived and matched the sender's checksum), its hash matches the tokens, and its
        bytes verify against the hash. A block whose hash is already cached here counts as
        committed but stays private (the cached copy serves). Returns, per block, whether it
        committed. Pins are unchanged: unpin every block id later.
        """
        ...

    def unpin(self, block_ids: list[int]) -> None: ...

    def checksum(self, block_id: int) -> int:
        """CRC-32 of the block's bytes, as the handle's `checksums` carry it."""
        ...

    def verify(self, block_id: int, block_hash: int) -> bool:
        """Whether the block's bytes are the KV of the block whose chain hash is `block_hash`."""
        ...
