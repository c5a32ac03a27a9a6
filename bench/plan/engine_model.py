"""One sim worker's engine as a timing model (pure): the batching policy of
`services.worker.sim.scheduler` over counts instead of tokens, and the step time from the
same `TimingProfile` the sim engine sleeps by.

What it keeps of the scheduler: running sequences oldest first, a decode (1 token) for each
before prefill chunks share what is left of `max_num_batched_tokens`; waiting sequences
admitted first come first served while `max_num_seqs` and free KV blocks allow; blocks
allocated as positions advance, the newest running sequence preempted (recomputed from
scratch) when none is free; reused prefix blocks cost no compute. Token ids, hashes and KV
bytes are left out: they do not change how long a step takes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from services.worker.sim.profile import TimingProfile
from shared.config import WorkerConfig


@dataclass(slots=True, eq=False)
class SeqModel:
    request: int  # the workload's request index
    num_tokens: int  # prompt (as this worker got it) + tokens generated here
    outputs_left: int  # tokens still to generate here
    reused_tokens: int = 0  # leading tokens whose KV is there without computing (cache hit or pulled)
    num_computed: int = 0
    blocks: int = 0  # blocks this sequence owns
    generated: int = 0

    def to_compute(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def decoding(self) -> bool:
        return self.generated > 0 and self.num_computed == self.num_tokens - 1


@dataclass(frozen=True, slots=True)
class StepPlan:
    duration_s: float
    sampled: list[tuple[SeqModel, bool]]  # (sequence, finished) for each sequence that made a token


class EngineModel:
    def __init__(self, worker_id: str, profile: TimingProfile, config: WorkerConfig, *, speedup: float = 1.0,
                 step_overhead_s: float = 0.0, seq_overhead_s: float = 0.0,
                 prefill_token_overhead_s: float = 0.0) -> None:
        self.worker_id = worker_id
        self.profile, self.speedup = profile, speedup
        self.block_size = config.block_size
        self.free_blocks = config.kv_blocks
        self.max_num_seqs, self.max_batched = config.max_num_seqs, config.max_num_batched_tokens
        self.step_overhead_s, self.seq_overhead_s = step_overhead_s, seq_overhead_s
        self.prefill_token_overhead_s = prefill_token_overhead_s
        self.running: list[SeqModel] = []
        self.waiting: deque[SeqModel] = deque()
        self.stepping = False
        self.preemptions = 0
        self.computed_prompt_tokens = 0  # prompt tokens computed so far (a worker's load report counts them)
        self.stall_s = 0.0  # real time the worker's loop is busy with other work (KV pulls), paid by the next step

    def add(self, seq: SeqModel) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def pending_prefill_tokens(self) -> int:
        return sum(seq.to_compute() - seq.reused_tokens * (seq.num_computed == 0)
                   for seq in (*self.running, *self.waiting) if not seq.decoding)

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def step(self) -> StepPlan:
        """Schedule and "compute" one step: its duration and the tokens it samples at its end."""
        budget, scheduled, preempted = self.max_batched, [], False
        decodes_left = sum(1 for seq in self.running if seq.to_compute() == 1)
        index = 0
        while index < len(self.running):
            seq = self.running[index]
            if seq.to_compute() == 1:
                decodes_left -= 1
                num_new = min(1, budget)
            else:
                num_new = min(seq.to_compute(), budget - decodes_left)
            if num_new <= 0:
                index += 1
                continue
            needed = self._blocks_for(seq.num_computed + num_new) - seq.blocks
            while needed > self.free_blocks:
                victim = self.running[-1]
                if victim is not seq and victim.to_compute() == 1:
                    decodes_left -= 1
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self.free_blocks -= max(needed, 0)
                seq.blocks += max(needed, 0)
                scheduled.append((seq, num_new))
                budget -= num_new
                index += 1
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            seq.num_computed = seq.reused_tokens  # reused blocks are there (cached or pulled)
            num_new = min(seq.to_compute(), budget)
            needed = self._blocks_for(seq.num_computed + num_new) - seq.blocks
            if needed > self.free_blocks:
                seq.num_computed = 0
                break
            self.waiting.popleft()
            self.free_blocks -= needed
            seq.blocks += needed
            self.running.append(seq)
            scheduled.append((seq, num_new))
            budget -= num_new
        return self._compute(scheduled)

    def _compute(self, scheduled: list[tuple[SeqModel, int]]) -> StepPlan:
        prefill_tokens = sum(num_new for seq, num_new in scheduled if not seq.decoding)
        self.computed_prompt_tokens += prefill_tokens
        decode_seqs = sum(1 for seq, _ in scheduled if seq.decoding)
        sampled = []
        for seq, num_new in scheduled:
            seq.num_computed += num_new
            if seq.num_computed == seq.num_tokens:
                seq.num_tokens += 1
                seq.generated += 1
                seq.outputs_left -= 1
                finished = seq.outputs_left <= 0
                if finished:
                    self.running.remove(seq)
                    self.free_blocks += seq.blocks
                    seq.blocks = 0
                sampled.append((seq, finished))
        duration = self.profile.step_duration_s(prefill_tokens=prefill_tokens, decode_seqs=decode_seqs) / self.speedup
        if scheduled:
            duration += (self.step_overhead_s + self.seq_overhead_s * len(scheduled) + self.stall_s
                         + self.prefill_token_overhead_s * prefill_tokens)
            self.stall_s = 0.0
        return StepPlan(duration_s=duration, sampled=sampled)

    def _preempt(self, seq: SeqModel) -> None:
        self.running.remove(seq)
        self.free_blocks += seq.blocks
        seq.blocks = 0
        seq.num_computed = 0
        seq.reused_tokens = 0  # its pulled or cached blocks went with it: all recomputed
        self.waiting.appendleft(seq)
        self.preemptions += 1
