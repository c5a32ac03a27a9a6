"""Which KV blocks each scheduled request holds, as vLLM's scheduler output says it step by
step (pure: reads the output's fields only). A request's blocks come whole when it is first
scheduled and when it resumes after a preemption, and as the blocks added since otherwise.

Callers (EngineCore's scheduler thread, `build_connector_meta`): `connector_scheduler.
SchedulerSide` for a push's blocks, `host_scheduler.HostScheduler` for the host tier's saves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput


class ScheduledBlocks:
    def __init__(self) -> None:
        self._block_ids: dict[str, list[int]] = {}  # request id -> its blocks (group 0), in token order

    def forget(self, request_id: str) -> None:
        self._block_ids.pop(request_id, None)

    def step(self, output: SchedulerOutput, wanted: Callable[[str], bool]) -> list[tuple[str, list[int], int, int]]:
        """Per scheduled request that `wanted` takes: its id, its blocks, the tokens computed
        before this step and the tokens this step computes."""
        steps: list[tuple[str, list[int], int, int]] = []
        scheduled = output.num_scheduled_tokens
        for new in output.scheduled_new_reqs:
            if wanted(new.req_id):
                block_ids = self._block_ids[new.req_id] = list(new.block_ids[0])
                steps.append((new.req_id, block_ids, new.num_computed_tokens, scheduled.get(new.req_id, 0)))
        cached = output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            if not wanted(req_id):
                continue
            new_ids = cached.new_block_ids[index]
            block_ids = self._block_ids.setdefault(req_id, [])
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    block_ids = self._block_ids[req_id] = list(new_ids[0])
                else:
                    block_ids.extend(new_ids[0])
            steps.append((req_id, block_ids, cached.num_computed_tokens[index], scheduled.get(req_id, 0)))
        return steps
