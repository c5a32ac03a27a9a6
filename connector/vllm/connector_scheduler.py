"""The scheduler side of Tandem's vLLM connector: runs in vLLM's EngineCore process, on its
engine thread (every method here is called by vLLM's scheduler; none blocks or does I/O
beyond a non-blocking report).

- Pull: a request whose `TransferOrder` names a holder's blocks reports them as external
  tokens (`matched_tokens`), minus the leading blocks already cached here, and always
  leaves at least one prompt token to compute. The load is asynchronous in vLLM's terms:
  once its blocks are allocated (`after_alloc`) the request waits, unscheduled, while the
  worker side reads them (`LoadSpec`); blocks that failed come back as vLLM's invalid
  blocks, and vLLM rolls the request back to its first failed block before it computes
  anything, so no forward pass is wasted. A request plans at most one load, even if
  preempted. vLLM counts a request's prompt tokens (loaded, cached, computed) when it is
  admitted; after a rollback `on_output` corrects that count to what was really loaded.
- Hold: when a request with a `hold_key` finishes (not aborted), its prompt's blocks (the
  full ones and the partial last one; a prompt shorter than a block, its one) get one extra
  reference each (`BlockPool.touch`, the same reference a prefix-cache hit takes), so vLLM
  neither evicts nor reuses them, and the block ids go out with the final output. A pull
  of a held partial block leaves the decode worker one token to compute, not the rest of
  a block. No delayed free: vLLM would step the engine every millisecond until it ended.
- Push, writer: a request whose order has a `PushOrder` gets a `PushSpec` in each step's
  metadata that completes prompt blocks (from the scheduler output: the request's blocks
  and the tokens this step computes); its prompt's last step also names the blocks found
  in the local prefix cache at admission (never computed here: written whole) and asks
  for the outcome (`final`).
- Push, reader (`AllocOrder`, `CommitOrder`): fresh blocks are taken from the pool and
  pinned for the writer; once the Tandem worker has verified what was written, the
  leading good blocks are cached under the prompt's block hashes (the control request
  carries the prompt), so the request itself, added next, finds them in the prefix cache;
  a partial last block is copied into the request's own (`push_tail`). No scheduled
  request waits meanwhile: an engine with only a waiting load would step without pause
  for the whole prefill on the other side.
- Host tier (`host_blocks` > 0): every computed block is also copied to host memory, and a
  request without a pull loads from there what its prompt has past vLLM's own cache hit
  (`host_scheduler.HostScheduler`: its copies go in the step's metadata, its events out
  through vLLM's event publisher).
- Control requests (`PinOrder`, `UnpinOrder`, `AllocOrder`, `CommitOrder`) arrive as
  pre-aborted requests and are applied in `on_new_request`. The Tandem worker owns lease
  lifetimes (grant, release, expiry); this side only counts references, keyed by the
  worker's keys.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.v1.request import RequestStatus

from connector.vllm.engine_hashes import EngineBlockHashes, cached_run
from connector.vllm.host_scheduler import HostScheduler
from connector.vllm.image_hashes import hash_with_images
from connector.vllm.kv_reports import ReportSender
from connector.vllm.kv_wire import (
    AllocOrder,
    CommitOrder,
    Held,
    HostCopy,
    LoadSpec,
    Pinned,
    PinOrder,
    PushOrder,
    PushSpec,
    TailCopy,
    TransferOrder,
    UnpinOrder,
    control_of,
    held_params,
    order_of,
)
from connector.vllm.pull_claim import claim_end, load_plan
from connector.vllm.push_tail import PushTails, pushed_tail
from connector.vllm.scheduled_blocks import ScheduledBlocks

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

_HOLDABLE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


@dataclass
class _Push:
    """A pushing request, as its steps are scheduled."""

    transfer_id: str
    order: PushOrder
    num_prompt_tokens: int
    reused: int | None = None  # leading blocks cached here at its first step (never computed)
    final_sent: bool = False


class SchedulerSide:
    def __init__(self, *, block_size: int, reports: ReportSender, host_blocks: int = 0) -> None:
        self.block_size = block_size
        self._reports = reports
        self.host = HostScheduler(host_blocks, block_size) if host_blocks else None
        self._block_pool: BlockPool | None = None
        self._orders: dict[str, TransferOrder] = {}  # vLLM request id -> order
        self._local_blocks: dict[str, int] = {}  # request id -> cached leading blocks at the last query
        self._planned: set[str] = set()  # requests whose load was handed to the worker side
        self._loading: dict[str, tuple[Request, int]] = {}  # request id -> (request, local tokens)
        self._loads: list[LoadSpec] = []  # for the next step's metadata
        self.tails = PushTails(block_size)  # a push's partial last block, copied (reader side)
        self._pins: dict[str, list[KVCacheBlock]] = {}  # key -> referenced blocks
        self._pushes: dict[str, _Push] = {}  # request id -> push (writer side)
        self._push_blocks = ScheduledBlocks()  # the pushing requests' blocks
        self._hashes: EngineBlockHashes | None = None  # vLLM's full block hashes by their events' form

    @property
    def pinned_blocks(self) -> int:
        return sum(len(blocks) for blocks in self._pins.values())

    def bind_block_pool(self, block_pool: BlockPool) -> None:
        self._block_pool = block_pool
        self._hashes = EngineBlockHashes(limit=4 * max(block_pool.num_gpu_blocks, 1))

    # ---- requests ----------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        control = control_of(request.kv_transfer_params)
        match control:
            case PinOrder(key=key, block_hashes=block_hashes):
                self._pin_cached_prefix(key, request, block_hashes)
            case UnpinOrder(keys=keys):
                for key in keys:
                    self._unpin(key)
            case AllocOrder(key=key, count=count):
                self._allocate(key, count)
            case CommitOrder(key=key, count=count, images=images, keep_next=keep_next):
                hash_with_images(request, images)
                self._commit(key, count, request, keep_next)
            case None:
                self._learn(request)
                if self.host is not None:
                    self.host.add(request)
                order = order_of(request.kv_transfer_params)
                if order is not None:
                    self._orders[request.request_id] = order
                    if order.push is not None:
                        self._pushes[request.request_id] = _Push(order.transfer_id, order.push,
                                                                 request.num_prompt_tokens)

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens the pull brings beyond the `num_computed_tokens` cached here (block-aligned)."""
        order = self._orders.get(request.request_id)
        tail = pushed_tail(order)
        if tail is not None:
            return self.tails.matched(request, tail, num_computed_tokens)
        if order is None or order.pull is None:
            return self.host.matched(request, num_computed_tokens) if self.host is not None else 0
        if request.request_id in self._planned:
            return 0
        pull = order.pull
        holder_size = pull.block_size or self.block_size
        held = (len(pull.block_ids) - (1 if pull.tail_tokens else 0)) * holder_size + pull.tail_tokens
        # vLLM computes at least one token of every prompt: never claim the last one.
        end = claim_end(usable_tokens=min(held, request.num_tokens - 1),
                        computed_tokens=num_computed_tokens, holder_block_size=holder_size, block_size=self.block_size)
        self._local_blocks[request.request_id] = num_computed_tokens // self.block_size
        return end - num_computed_tokens

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        order = self._orders.get(request.request_id)
        tail = pushed_tail(order)
        if tail is not None:
            (block_ids,) = blocks.get_block_ids()
            local_tokens = self.tails.after_alloc(request, tail, list(block_ids), num_external_tokens)
            if local_tokens is not None:
                self._loading[request.request_id] = (request, local_tokens)
            return
        if (order is None or order.pull is None) and self.host is not None:
            (host_block_ids,) = blocks.get_block_ids()
            local_tokens = self.host.after_alloc(request, list(host_block_ids), num_external_tokens)
            if local_tokens is not None:
                self._loading[request.request_id] = (request, local_tokens)
            return
        if order is None or order.pull is None or request.request_id in self._planned:
            return
        self._planned.add(request.request_id)
        pull = order.pull
        holder_size = pull.block_size or self.block_size
        computed = self._local_blocks.pop(request.request_id, 0) * self.block_size
        plan = load_plan(computed_tokens=computed, external_tokens=num_external_tokens, holder_block_size=holder_size,
                         block_size=self.block_size)
        (block_ids,) = blocks.get_block_ids()
        if num_external_tokens:
            self._loading[request.request_id] = (request, computed)
        heads = len(pull.checksums) // len(pull.block_ids) if pull.block_ids else 0
        units = slice(plan.first_unit, plan.first_unit + plan.units if num_external_tokens else plan.first_unit)
        # Always a spec, even an empty one: the worker side reports every planned pull, so the
        # Tandem worker hears one outcome per order (here: "all cached locally").
        self._loads.append(LoadSpec(
            request_id=request.request_id, transfer_id=order.transfer_id, lease_id=pull.lease_id,
            agent_name=pull.agent_name, agent_metadata=pull.agent_metadata, remote_block_ids=pull.block_ids[units],
            local_block_ids=list(block_ids[plan.first_local:plan.first_local + plan.local_blocks])
            if num_external_tokens else [], checksums=pull.checksums[units.start * heads:units.stop * heads],
            cached_blocks=plan.first_unit, block_size=holder_size, tokens=plan.tokens))

    def take_loads(self) -> list[LoadSpec]:
        loads, self._loads = self._loads, []
        return loads

    def take_tail_copies(self) -> list[TailCopy]:
        return self.tails.take()

    def take_host_copies(self, output: SchedulerOutput) -> tuple[list[HostCopy], list[HostCopy]]:
        """This step's host-tier loads and saves (none without a host tier)."""
        if self.host is None:
            return [], []
        return self.host.take_loads(), self.host.take_saves(output)

    def take_events(self) -> list[KVCacheEvent]:
        return self.host.take_events() if self.host is not None else []

    def take_pushes(self, output: SchedulerOutput) -> list[PushSpec]:
        """What this step writes of each pushing request it computes."""
        if not self._pushes:
            return []
        specs: list[PushSpec] = []
        for request_id, block_ids, computed, scheduled in self._push_blocks.step(output, self._pushes.__contains__):
            self._push_step(request_id, self._pushes[request_id], block_ids, computed, scheduled, specs)
        return specs

    def _push_step(self, request_id: str, push: _Push, block_ids: list[int], computed: int, scheduled: int,
                   specs: list[PushSpec]) -> None:
        if push.final_sent or scheduled <= 0:
            return
        target = push.order.block_ids
        if push.reused is None:
            push.reused = computed // self.block_size
        end = computed + scheduled
        # Blocks whose last token this step computes: their every layer is final as that
        # layer's attention ends in this step's forward pass.
        indices = list(range(computed // self.block_size, min(end // self.block_size, len(target))))
        final = end >= push.num_prompt_tokens
        full, tail_tokens = divmod(push.num_prompt_tokens, self.block_size)
        if final and tail_tokens and len(target) > full:  # the partial last block, final now: whole
            indices.append(full)
        whole = list(range(min(push.reused, len(target)))) if final else []
        if not indices and not final:
            return
        push.final_sent = final
        specs.append(PushSpec(
            request_id=request_id, transfer_id=push.transfer_id, agent_name=push.order.agent_name,
            agent_metadata=push.order.agent_metadata, target_block_ids=target, indices=indices,
            local_block_ids=[block_ids[index] for index in indices], whole_indices=whole,
            whole_local_block_ids=[block_ids[index] for index in whole], final=final))

    def on_output(self, finished_recving: set[str]) -> None:
        """After vLLM applied a step's loads (and rolled back failed ones): make its prompt-token
        statistics say what was loaded rather than what was promised."""
        for request_id in finished_recving:
            request, local_tokens = self._loading.pop(request_id, (None, 0))
            if request is None or request.prefill_stats is None:
                continue
            loaded = max(0, request.num_computed_tokens - local_tokens)
            if loaded != request.prefill_stats.num_external_cached_tokens:
                request.prefill_stats.set(num_prompt_tokens=request.num_prompt_tokens,
                                          num_local_cached_tokens=local_tokens, num_external_cached_tokens=loaded)

    def request_finished(self, request: Request, block_ids: list[int]) -> dict[str, Any] | None:
        self._learn(request)  # its generated blocks too
        if self.host is not None:
            self.host.finished(request.request_id)
        self._planned.discard(request.request_id)
        self.tails.finished(request.request_id)
        self._local_blocks.pop(request.request_id, None)
        self._loading.pop(request.request_id, None)
        self._pushes.pop(request.request_id, None)
        self._push_blocks.forget(request.request_id)
        order = self._orders.pop(request.request_id, None)
        if order is None or not order.hold_key or request.status not in _HOLDABLE:
            return None
        full, tail_tokens = divmod(request.num_prompt_tokens, self.block_size)
        held = block_ids[: full + 1 if tail_tokens else full]  # a prompt shorter than a block: its one partial block
        if not held:
            return None
        self._pin(order.hold_key, held)
        return held_params(Held(key=order.hold_key, block_ids=list(held),
                                tail_tokens=tail_tokens if len(held) > full else 0))

    # ---- pins ------------------------------------------------------------------------------

    def _pin_cached_prefix(self, key: str, request: Request, short_hashes: list[int]) -> None:
        """Pin the longest run of the announced blocks (`short_hashes`, as vLLM's events gave
        them) still cached, or of the control request's own prompt blocks where that finds
        more: its hashes miss the images, adapter and salt a block was computed with."""
        pool = self._block_pool
        assert pool is not None, "the block pool is bound before any request"
        announced = self._hashes.leading(short_hashes) if self._hashes is not None and short_hashes else []
        found = max(cached_run(pool, announced), cached_run(pool, request.block_hashes), key=len)
        if found:
            self._pin(key, found)
        self._reports.send(Pinned(key=key, block_ids=found))

    def _learn(self, request: Request) -> None:
        if self._hashes is not None:
            self._hashes.learn(request.block_hashes)

    def _allocate(self, key: str, count: int) -> None:
        """Fresh blocks for a writer to fill (none if the pool cannot spare them)."""
        pool = self._block_pool
        assert pool is not None, "the block pool is bound before any request"
        blocks: list[KVCacheBlock] = []
        if 0 < count <= pool.get_num_free_blocks():
            blocks = pool.get_new_blocks(count)  # one reference each: ours until unpinned
            self._pins.setdefault(key, []).extend(blocks)
        self._reports.send(Pinned(key=key, block_ids=[block.block_id for block in blocks]))

    def _commit(self, key: str, count: int, request: Request, keep_next: bool = False) -> None:
        """Cache the first `count` blocks under `key` as the request's prompt blocks (they
        stay pinned); unpin the others, but for the next one where `keep_next` and it is the
        last (a partial last block, pinned uncached until the request copied it)."""
        pool = self._block_pool
        assert pool is not None
        blocks = self._pins.pop(key, [])
        count = min(count, len(blocks), len(request.block_hashes))
        kept, dropped = blocks[:count], blocks[count:]
        if kept:
            pool.cache_full_blocks(request, kept, 0, count, self.block_size, 0)
        if keep_next and len(dropped) == 1:  # the partial last block: answered after the cached ones
            kept, dropped = kept + dropped, []
        if kept:
            self._pins[key] = kept
        if dropped:
            pool.free_blocks(dropped)
        self._reports.send(Pinned(key=key, block_ids=[block.block_id for block in kept]))

    def _pin(self, key: str, block_ids: list[int]) -> None:
        pool = self._block_pool
        assert pool is not None
        blocks = [pool.blocks[block_id] for block_id in block_ids]
        pool.touch(blocks)
        self._pins.setdefault(key, []).extend(blocks)

    def _unpin(self, key: str) -> None:
        blocks = self._pins.pop(key, None)
        if blocks and self._block_pool is not None:
            # Tail blocks first: they are the least likely to be shared by other prefixes.
            self._block_pool.free_blocks(reversed(blocks))
