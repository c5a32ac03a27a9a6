"""Continuous batching with chunked prefill and prefix caching (pure, synchronous).

The sim engine calls `step(now)` in a loop; the scheduler never sleeps, reads a clock or
touches a queue. One step, in the spirit of vLLM v1:

1. running requests, oldest first: a decoding request computes 1 token; a prefilling one
   computes a chunk of what the token budget (`max_num_batched_tokens`) leaves after
   reserving 1 token for every decode. A request that cannot get a block preempts the
   newest running request (its blocks are freed and it is requeued to be recomputed),
   itself if it is the newest;
2. if nothing was preempted, waiting requests are admitted first come, first served while
   `max_num_seqs` and blocks allow. Admission (`admission.admit`) reuses *every* cached
   block of the prompt's hash chain, not only the leading run: a chain hash covers the
   whole prefix, so a cached block is valid KV even when an earlier one is missing (after a
   partial KV transfer, only the failed blocks are computed). Reused tokens cost no budget,
   and at least one token is always computed so the last token's logits exist (a fully
   cached prompt recomputes its last block). Blocks for the holes up to the last reused
   block are allocated at once. A host-tier block (`host_tier`) is loaded back at
   admission, at the profile's `host_load_ms_per_token` instead of its compute;
3. the scheduled tokens are "computed" (a request's position, with the reused blocks it
   skips, is `request.SimRequest`'s): prefill walks the missing blocks in order, then the
   tail, skipping reused ones. Blocks that became full are committed to the prefix cache
   (announced as KV events) and reported in `StepResult.computed_blocks`; KV bytes are
   written for computed blocks only. A request whose tokens are all computed verifies the
   KV bytes of its full blocks once per prefill (a corrupt block perturbs its tokens, as
   wrong KV would in a real engine), samples its next token, and frees its blocks when it
   finishes.

The step's simulated duration comes from the timing profile.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import groupby

from services.worker.engine import EngineLoad, EngineOutput, check_request
from services.worker.sim.admission import admit
from services.worker.sim.block_manager import BlockManager
from services.worker.sim.kv_pool import KvPool
from services.worker.sim.profile import TimingProfile
from services.worker.sim.request import SimRequest
from services.worker.sim.request_kv import append_token, kv_intact, start_seeds, write_kv
from services.worker.sim.tokens import (
    DEFAULT_FIRST_NORMAL_TOKEN,
    finish_reason,
    fold_token,
    fold_tokens,
    history_root,
    next_token,
    refuse_unmodelled,
)
from shared.block_hash import block_hash_chain, chain_root, hash_block
from shared.errors import InvalidArgument
from shared.schemas.generate import FinishReason, SamplingParams

CORRUPT_KV_MARK = 0xBAD_C0DE  # folded into the tokens of a request whose KV failed verification


@dataclass(slots=True)
class StepResult:
    now: float
    duration_s: float  # simulated compute time of this step
    outputs: dict[str, EngineOutput]  # request id -> new tokens (and finish) this step
    prefill_tokens: int = 0
    decode_seqs: int = 0
    loaded_tokens: int = 0  # prompt tokens loaded back from the host tier for requests admitted in it
    preempted: list[str] = field(default_factory=list)
    # request id -> its prompt blocks that prefill filled completely in this step, in token
    # order (reused blocks are never in it). The ids stay valid until the next step, even for
    # a request that finished in this one: nothing allocates in between.
    computed_blocks: dict[str, list[int]] = field(default_factory=dict)


class Scheduler:
    def __init__(self, *, blocks: BlockManager, pool: KvPool | None, profile: TimingProfile, vocab_size: int,
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 first_normal_token: int = DEFAULT_FIRST_NORMAL_TOKEN) -> None:
        assert pool is None or (pool.num_blocks == blocks.num_blocks and pool.block_size == blocks.block_size)
        assert vocab_size > first_normal_token
        self.blocks = blocks
        self.pool = pool  # None: no KV bytes (scale tests that only need timing and events)
        self.profile = profile
        self.vocab_size = vocab_size
        self.first_normal_token = first_normal_token
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.block_size = blocks.block_size
        self._requests: dict[str, SimRequest] = {}
        self._running: list[SimRequest] = []  # admission order: oldest first
        self._waiting: deque[SimRequest] = deque()
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.generated_tokens_total = 0
        self.preemptions_total = 0
        # Prefill tokens actually computed (reused ones excluded); recomputation after a
        # preemption counts again.
        self.computed_prompt_tokens_total = 0
        self.loaded_prompt_tokens_total = 0  # prompt tokens loaded back from the host tier
        self._loaded_tokens = 0  # ... in the step being scheduled

    # ---- requests ------------------------------------------------------------------------

    def validate_request(self, request_id: str, token_ids: list[int], sampling: SamplingParams) -> None:
        """Raise InvalidArgument if the request can never run here; queue nothing."""
        if request_id in self._requests:
            raise InvalidArgument(f"duplicate request id {request_id!r}")
        check_request(token_ids, sampling, vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        refuse_unmodelled(sampling)
        prompt_len = len(token_ids)
        # The last generated token needs no KV slot.
        blocks_needed = -(-(prompt_len + sampling.max_tokens - 1) // self.block_size)
        if blocks_needed > self.blocks.num_blocks:
            raise InvalidArgument(f"the request needs {blocks_needed} KV blocks, the whole pool has "
                                  f"{self.blocks.num_blocks}")

    def add_request(self, request_id: str, token_ids: list[int], sampling: SamplingParams, *,
                    adapter: str = "", cache_salt: str = "") -> None:
        """`adapter`: the LoRA adapter it runs with ("": the base model), which seeds both its
        tokens (`history_root`) and its KV's chain (`chain_root`, with `cache_salt`)."""
        self.validate_request(request_id, token_ids, sampling)
        root = chain_root(adapter, cache_salt)
        request = SimRequest(request_id=request_id, token_ids=list(token_ids), num_prompt_tokens=len(token_ids),
                             sampling=sampling, block_size=self.block_size,
                             history_state=fold_tokens(token_ids, history_root(adapter)),
                             block_hashes=block_hash_chain(token_ids, self.block_size, parent_hash=root),
                             adapter=adapter, cache_salt=cache_salt, root_hash=root)
        start_seeds(request)
        self._requests[request_id] = request
        self._waiting.append(request)

    def abort(self, request_id: str) -> EngineOutput | None:
        """Drop a request and free its blocks now; its final output, or None if unknown."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        if request in self._running:
            self._running.remove(request)
        else:
            self._waiting.remove(request)
        self.blocks.free(request.block_ids)
        request.block_ids = []
        return self._output(request, [], "abort")

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def block_ids(self, request_id: str) -> list[int]:
        """The blocks holding a live request's KV, in token order (empty while it waits)."""
        return list(self._requests[request_id].block_ids)

    def prompt_block_ids(self, request_id: str) -> list[int]:
        """The blocks of a live request's prompt allocated so far, in token order; empty for
        an unknown or finished request and while it waits (or was preempted)."""
        request = self._requests.get(request_id)
        if request is None:
            return []
        return request.block_ids[:-(-request.num_prompt_tokens // self.block_size)]

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    # ---- one step --------------------------------------------------------------------------

    def step(self, now: float) -> StepResult:
        self._loaded_tokens = 0
        scheduled, preempted = self._schedule()
        result = StepResult(now=now, duration_s=0.0, outputs={}, preempted=preempted,
                            loaded_tokens=self._loaded_tokens)
        size = self.block_size
        for request, num_new, end in scheduled:
            prefill = not request.is_decoding
            if prefill:
                result.prefill_tokens += num_new
                self.computed_prompt_tokens_total += num_new
            else:
                result.decode_seqs += 1
            computed = request.advance(end)
            full = [index for index in computed if (index + 1) * size <= end]
            self._commit(request, full)
            if self.pool is not None:
                write_kv(self.pool, request, computed, end)
            prompt_blocks = [request.block_ids[index] for index in full
                             if (index + 1) * size <= request.num_prompt_tokens] if prefill else []
            if prompt_blocks:
                result.computed_blocks[request.request_id] = prompt_blocks
            if request.num_computed_tokens == request.num_tokens:
                result.outputs[request.request_id] = self._sample(request)
        result.duration_s = self.profile.step_duration_s(prefill_tokens=result.prefill_tokens,
                                                         decode_seqs=result.decode_seqs,
                                                         loaded_tokens=result.loaded_tokens)
        return result

    def _schedule(self) -> tuple[list[tuple[SimRequest, int, int]], list[str]]:
        """What to compute: (request, tokens to compute, position reached after them)."""
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[SimRequest, int, int]] = []
        preempted: list[str] = []
        # Decodes are served before prefill chunks: reserve their tokens up front.
        decodes_left = sum(1 for request in self._running if request.to_compute() == 1)
        index = 0
        while index < len(self._running):
            request = self._running[index]
            remaining = request.to_compute()
            if remaining == 1:
                decodes_left -= 1
                num_new = min(1, budget)
            else:
                num_new = min(remaining, budget - decodes_left)
            if num_new <= 0:
                index += 1
                continue
            end = request.chunk_end(num_new)
            while not self._reserve_slots(request, end):
                victim = self._running[-1]  # the newest; never one scheduled earlier in this loop
                if victim is not request and victim.to_compute() == 1:
                    decodes_left -= 1
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new, end))
                budget -= num_new
                index += 1
        if preempted:
            return scheduled, preempted  # the pool is full: admitting more would thrash
        while self._waiting and budget > 0 and len(self._running) < self.max_num_seqs:
            request = self._waiting[0]
            chunk = self._admit(request, budget)
            if chunk is None:
                break
            self._waiting.popleft()
            self._running.append(request)
            scheduled.append((request, *chunk))
            budget -= chunk[0]
        return scheduled, preempted

    def _admit(self, request: SimRequest, budget: int) -> tuple[int, int] | None:
        """`admission.admit`, counted: (tokens to compute, position after them), or None if
        blocks are short."""
        first = request.num_cached_tokens < 0  # not a resumption after preemption
        admission = admit(self.blocks, self.pool, request, budget)
        self.loaded_prompt_tokens_total += admission.loaded_tokens
        self._loaded_tokens += admission.loaded_tokens
        if admission.chunk is not None and first:
            self.prompt_tokens_total += request.num_prompt_tokens
            self.cached_tokens_total += request.num_cached_tokens
        return admission.chunk

    def _reserve_slots(self, request: SimRequest, num_tokens: int) -> bool:
        needed = -(-num_tokens // self.block_size) - len(request.block_ids)
        if needed <= 0:
            return True
        new_blocks = self.blocks.allocate(needed)
        if new_blocks is None:
            return False
        request.block_ids.extend(new_blocks)
        return True

    def _preempt(self, request: SimRequest) -> None:
        """Recompute-style preemption: free everything, requeue at the head of the queue."""
        self._running.remove(request)
        self.blocks.free(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0
        request.reused_ahead.clear()
        self._waiting.appendleft(request)
        self.preemptions_total += 1

    # ---- "computing" -----------------------------------------------------------------------

    def _commit(self, request: SimRequest, full: list[int]) -> None:
        """Cache the blocks at indices `full` (ascending), one commit per consecutive run."""
        size = self.block_size
        for _, run in groupby(enumerate(full), key=lambda pair: pair[1] - pair[0]):
            indices = [index for _, index in run]
            first, stop = indices[0], indices[-1] + 1
            self.blocks.commit(request.block_ids[first:stop], request.block_hashes[first:stop],
                               request.token_ids[first * size:stop * size],
                               request.block_hashes[first - 1] if first else None, adapter=request.adapter,
                               cache_salt=request.cache_salt,
                               seeds=request.seeds[first:stop])

    def _sample(self, request: SimRequest) -> EngineOutput:
        if not request.kv_checked:  # once per prefill: the blocks it reused may be anyone's bytes
            request.kv_checked = True
            request.kv_corrupt = self.pool is not None and not kv_intact(self.pool, request)
        state = fold_token(request.history_state, CORRUPT_KV_MARK) if request.kv_corrupt else request.history_state
        made, replayed = request.num_output_tokens, request.sampling.replayed
        token_id = replayed[made] if made < len(replayed) else \
            next_token(state, request.sampling, self.vocab_size, self.first_normal_token)
        append_token(request, token_id)
        request.history_state = fold_token(request.history_state, token_id)
        size = self.block_size
        if request.num_tokens % size == 0:
            parent = request.block_hashes[-1] if request.block_hashes else request.root_hash
            request.block_hashes.append(hash_block(parent, request.token_ids[-size:]))
        self.generated_tokens_total += 1
        reason = finish_reason(token_id, request.num_output_tokens, request.sampling)
        if reason is not None:
            self._running.remove(request)
            del self._requests[request.request_id]
            self.blocks.free(request.block_ids)
            request.block_ids = []
        return self._output(request, [token_id], reason)

    def _output(self, request: SimRequest, token_ids: list[int], reason: FinishReason | None) -> EngineOutput:
        if reason is None:
            return EngineOutput(token_ids=token_ids)
        return EngineOutput(token_ids=token_ids, finish_reason=reason, prompt_tokens=request.num_prompt_tokens,
                            cached_tokens=max(request.num_cached_tokens, 0),
                            completion_tokens=request.num_output_tokens)

    # ---- load ------------------------------------------------------------------------------

    def load(self) -> EngineLoad:
        pending = sum(request.to_compute() for queue in (self._running, self._waiting) for request in queue
                      if not request.is_decoding)
        return EngineLoad(running=len(self._running), waiting=len(self._waiting),
                          kv_total_blocks=self.blocks.num_blocks, kv_used_blocks=self.blocks.used_blocks,
                          kv_cached_blocks=self.blocks.cached_blocks,
                          prompt_tokens_total=self.prompt_tokens_total,
                          cached_tokens_total=self.cached_tokens_total,
                          generated_tokens_total=self.generated_tokens_total,
                          pending_prefill_tokens=pending,
                          computed_prompt_tokens_total=self.computed_prompt_tokens_total,
                          kv_evicted_blocks_total=self.blocks.evicted_blocks_total,
                          kv_evicted_missed_blocks_total=self.blocks.evicted_missed_blocks_total)
