"""The host-memory tier of Tandem's vLLM connector, its scheduler half: runs in vLLM's
EngineCore process, on the scheduler thread (called by `connector_scheduler.SchedulerSide`).

- Save (write-through): each step, every full block a scheduled request computes in that
  step gets a host slot (`host_slots.HostSlots`, least recently used reused); the worker
  side copies it there after the forward pass (`HostCopy` without a request id).
- Load: a request (without a pull order) whose prompt continues in the host tier past vLLM's
  own prefix-cache hit reports those blocks as external tokens (`matched`), always leaving
  one prompt token to compute; once its blocks are allocated (`after_alloc`) the worker side
  copies them in (`HostCopy` with the request id) in that step and reports the request
  finished loading, as a pull's would be.
- Events: a block saved is announced as vLLM's own `BlockStored` with medium "CPU", a block
  whose slot is taken as `BlockRemoved` "CPU"; vLLM publishes them (`take_events`) in the
  step's batch, after its own cache's events, so the Tandem worker sees each block's tiers
  in order (`services.worker.vllm.kv_mirror`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from connector.vllm.host_slots import HostSlots
from connector.vllm.kv_wire import HostCopy
from connector.vllm.scheduled_blocks import ScheduledBlocks

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class HostScheduler:
    def __init__(self, capacity: int, block_size: int) -> None:
        self.slots = HostSlots(capacity)
        self.block_size = block_size
        self._requests: dict[str, Request] = {}  # scheduled or waiting, until finished
        self._blocks = ScheduledBlocks()
        self._first: dict[str, int] = {}  # request id -> first block of the load `matched` offered
        self._loads: list[HostCopy] = []
        self._events: list[KVCacheEvent] = []

    def add(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def finished(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._blocks.forget(request_id)
        self._first.pop(request_id, None)

    def matched(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens the host tier holds past the `num_computed_tokens` cached in vLLM (block-aligned)."""
        first = num_computed_tokens // self.block_size
        held = self.slots.run(request.block_hashes, first)
        usable = min((first + held) * self.block_size, request.num_tokens - 1) - num_computed_tokens
        if usable <= 0:
            return 0
        self._first[request.request_id] = first
        return usable

    def after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> int | None:
        """Plan the load of the tokens `matched` offered; the tokens cached in vLLM before
        them, or None if there is no load to plan."""
        first = self._first.pop(request.request_id, None)
        if first is None or num_external_tokens <= 0:
            return None
        count = -(-(first * self.block_size + num_external_tokens) // self.block_size) - first
        hashes = request.block_hashes[first:first + count]
        self._loads.append(HostCopy(block_ids=list(block_ids[first:first + count]), slots=self.slots.take(hashes),
                                    request_id=request.request_id))
        return first * self.block_size

    def take_loads(self) -> list[HostCopy]:
        loads, self._loads = self._loads, []
        return loads

    def take_saves(self, output: SchedulerOutput) -> list[HostCopy]:
        """This step's saves: the full blocks each scheduled request computes in it."""
        saves: list[HostCopy] = []
        for request_id, block_ids, computed, scheduled in self._blocks.step(output, self._requests.__contains__):
            self._save(self._requests[request_id], block_ids, computed, scheduled, saves)
        return saves

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def _save(self, request: Request, block_ids: list[int], computed: int, scheduled: int,
              saves: list[HostCopy]) -> None:
        if scheduled <= 0:
            return
        size = self.block_size
        # Blocks whose last token this step computes (their hash exists: they are full).
        last = min((computed + scheduled) // size, len(request.block_hashes), len(block_ids))
        stored: list[int] = []
        copy_blocks: list[int] = []
        copy_slots: list[int] = []
        evicted: list[int] = []
        for index in range(computed // size, last):
            placed = self.slots.store(request.block_hashes[index])
            if placed is None:
                continue  # held already (loaded from here, or computed by another request)
            slot, old = placed
            if old is not None:
                evicted.append(maybe_convert_block_hash(old))
            stored.append(index)
            copy_blocks.append(block_ids[index])
            copy_slots.append(slot)
        if evicted:
            self._events.append(BlockRemoved(block_hashes=evicted, medium=MEDIUM_CPU))
        if stored:
            saves.append(HostCopy(block_ids=copy_blocks, slots=copy_slots))
            self._announce(request, stored)

    def _announce(self, request: Request, indices: list[int]) -> None:
        """`BlockStored` "CPU" events for these blocks of the request, one per consecutive run."""
        size = self.block_size
        lora = request.lora_request
        runs: list[list[int]] = []
        for index in indices:
            if runs and runs[-1][-1] == index - 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        for run in runs:
            parent = request.block_hashes[run[0] - 1] if run[0] else None
            self._events.append(BlockStored(
                block_hashes=[maybe_convert_block_hash(request.block_hashes[index]) for index in run],
                parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),
                token_ids=list(request.all_token_ids[run[0] * size:(run[-1] + 1) * size]), block_size=size,
                lora_id=lora.lora_int_id if lora is not None else None, medium=MEDIUM_CPU,
                lora_name=lora.lora_name if lora is not None else None))
