"""A push's partial last block on the reader's side, the scheduler half (runs in vLLM's
EngineCore, called by `connector_scheduler.SchedulerSide`).

vLLM's prefix cache holds only full blocks, so the reader caches a push's full blocks
(`CommitOrder`) and keeps the partial last one pinned, uncached (`keep_next`). The request
(the prompt and the pushed first token), added next with a `TailOrder`, finds the full blocks
cached; `matched` then offers the tail's tokens as external, and once the request's blocks
are allocated (`after_alloc`) the worker side copies the pinned block whole into the
request's own block in that step (`TailCopy`) and reports the request loaded, as the host
tier does. The decode worker computes one token, as after a pull, not up to a block of them.

A tail is copied at most once, even if the request is preempted: its source block is
unpinned once the request was admitted. Where the full blocks are not all cached (the commit
kept fewer), nothing is copied and vLLM computes the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from connector.vllm.kv_wire import TailCopy, TailOrder, TransferOrder

if TYPE_CHECKING:
    from vllm.v1.request import Request


class PushTails:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._planned: set[str] = set()  # requests whose tail was offered, copied or not
        self._copies: list[TailCopy] = []  # for the next step's metadata

    def start(self, request: Request, tail: TailOrder) -> int:
        """Where the tail's tokens start in the request's prompt (the prompt and the pushed
        first token); -1 where that is not a block boundary or the tail not partial."""
        start = request.num_prompt_tokens - 1 - tail.tokens
        whole_blocks = start >= 0 and start % self.block_size == 0
        return start if whole_blocks and 0 < tail.tokens < self.block_size else -1

    def matched(self, request: Request, tail: TailOrder, num_computed_tokens: int) -> int:
        """The tail's tokens, where every full block before it is cached here; else none."""
        if request.request_id in self._planned:
            return 0
        start = self.start(request, tail)
        return tail.tokens if start >= 0 and num_computed_tokens == start else 0

    def after_alloc(self, request: Request, tail: TailOrder, block_ids: list[int],
                    num_external_tokens: int) -> int | None:
        """Plan the copy into the request's block for the tail; the tokens cached before it
        (the load's local tokens), or None where nothing is copied."""
        if request.request_id in self._planned:
            return None
        self._planned.add(request.request_id)
        start = self.start(request, tail)
        if not num_external_tokens or start < 0:
            return None
        self._copies.append(TailCopy(request_id=request.request_id, source=tail.block_id,
                                     target=block_ids[start // self.block_size]))
        return start

    def take(self) -> list[TailCopy]:
        copies, self._copies = self._copies, []
        return copies

    def finished(self, request_id: str) -> None:
        self._planned.discard(request_id)


def pushed_tail(order: TransferOrder | None) -> TailOrder | None:
    """A request's push tail to copy in: its order's tail where the order pulls nothing."""
    return order.tail if order is not None and order.pull is None else None
