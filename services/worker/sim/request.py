"""One request inside the sim scheduler: its tokens, blocks and how far its KV is computed
(pure). `scheduler.Scheduler` owns every `SimRequest` and is the only caller.

The position arithmetic lives here: a request's computed prefix may jump over blocks it
reused from the cache (holes after a partial KV transfer are computed, the blocks around
them are not), so "how much is left", "where does a chunk end" and "which blocks did
this step compute" all skip the reused blocks ahead (`reused_ahead`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from shared.block_hash import ROOT_PARENT
from shared.schemas.generate import SamplingParams


@dataclass(slots=True, eq=False)
class SimRequest:
    request_id: str
    token_ids: list[int]  # prompt, then generated tokens
    num_prompt_tokens: int
    sampling: SamplingParams
    block_size: int
    history_state: int  # `tokens.fold_tokens(token_ids, tokens.history_root(adapter))`, kept up to date
    block_hashes: list[int]  # chain hash of every full block of token_ids, from `root_hash`
    adapter: str = ""  # the LoRA adapter it runs with ("": the base model)
    cache_salt: str = ""  # vLLM's cache salt ("": none)
    # the parent of its first block: `shared.block_hash.chain_root(adapter, cache_salt)`
    root_hash: int = ROOT_PARENT
    block_ids: list[int] = field(default_factory=list)
    # Every token before this position has KV in block_ids, computed or reused. It never
    # rests at the start of a reused block: computing skips over them.
    num_computed_tokens: int = 0
    reused_ahead: deque[int] = field(default_factory=deque)  # indices of reused blocks past it, ascending
    num_cached_tokens: int = -1  # prompt tokens reused at first admission; -1 before it
    kv_checked: bool = False  # its full blocks' KV was verified since its last admission
    kv_corrupt: bool = False  # ... and some block was corrupt: its tokens are perturbed
    # the content seed of every block started so far, and the prefix hash after the last
    # token (`kv_content`; kept by `request_kv`)
    seeds: list[int] = field(default_factory=list)
    last_prefix: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_decoding(self) -> bool:
        return self.num_output_tokens > 0 and self.num_computed_tokens == self.num_tokens - 1

    def to_compute(self) -> int:
        """Tokens of the request still to compute (reused blocks ahead excluded)."""
        return self.num_tokens - self.num_computed_tokens - len(self.reused_ahead) * self.block_size

    def chunk_end(self, num_new: int) -> int:
        """The position computing `num_new` more tokens reaches, skipping reused blocks
        (also those right after the chunk)."""
        size = self.block_size
        position = self.num_computed_tokens
        reused = iter(self.reused_ahead)
        next_reused = next(reused, None)
        left = num_new
        while left:
            stop = self.num_tokens if next_reused is None else next_reused * size
            assert stop > position, "the chunk is longer than what is left to compute"
            take = min(left, stop - position)
            position += take
            left -= take
            while next_reused is not None and position == next_reused * size:
                position += size
                next_reused = next(reused, None)
        return position

    def advance(self, end: int) -> list[int]:
        """Move the request to position `end`; the indices of the blocks it computed on the way
        (the last one may be partial)."""
        first = self.num_computed_tokens // self.block_size
        stop = -(-end // self.block_size)
        skipped: set[int] = set()
        while self.reused_ahead and self.reused_ahead[0] < stop:
            skipped.add(self.reused_ahead.popleft())
        self.num_computed_tokens = end
        return [index for index in range(first, stop) if index not in skipped]
