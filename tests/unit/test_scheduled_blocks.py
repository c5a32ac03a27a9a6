"""Each scheduled request's blocks from vLLM's scheduler output (`connector.vllm.
scheduled_blocks.ScheduledBlocks`): whole at the first step and on resumption, added to
otherwise. Pure; the output is plain data here, with the fields vLLM's has."""

from __future__ import annotations

from types import SimpleNamespace

from connector.vllm.scheduled_blocks import ScheduledBlocks


def output(new=(), cached=(), resumed=()) -> SimpleNamespace:
    """new: (id, blocks, computed, scheduled); cached: (id, new blocks or None, computed, scheduled)."""
    return SimpleNamespace(
        num_scheduled_tokens={req_id: scheduled for req_id, _, _, scheduled in (*new, *cached)},
        scheduled_new_reqs=[SimpleNamespace(req_id=req_id, block_ids=(blocks,), num_computed_tokens=computed)
                            for req_id, blocks, computed, _ in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[req_id for req_id, _, _, _ in cached],
            new_block_ids=[None if blocks is None else (blocks,) for _, blocks, _, _ in cached],
            num_computed_tokens=[computed for _, _, computed, _ in cached], resumed_req_ids=set(resumed)))


def test_blocks_come_whole_then_grow_and_come_whole_again_on_resumption() -> None:
    blocks = ScheduledBlocks()
    assert blocks.step(output(new=[("a", [3, 4], 0, 256), ("b", [5], 0, 16)]), lambda r: r == "a") == \
        [("a", [3, 4], 0, 256)]
    assert blocks.step(output(cached=[("a", [7], 256, 1)]), lambda r: True) == [("a", [3, 4, 7], 256, 1)]
    assert blocks.step(output(cached=[("a", None, 257, 1)]), lambda r: True) == [("a", [3, 4, 7], 257, 1)]
    assert blocks.step(output(cached=[("a", [9, 8], 0, 300)], resumed={"a"}), lambda r: True) == \
        [("a", [9, 8], 0, 300)]


def test_a_forgotten_request_starts_over() -> None:
    blocks = ScheduledBlocks()
    blocks.step(output(new=[("a", [3], 0, 16)]), lambda r: True)
    blocks.forget("a")
    assert blocks.step(output(cached=[("a", [4], 16, 1)]), lambda r: True) == [("a", [4], 16, 1)]
