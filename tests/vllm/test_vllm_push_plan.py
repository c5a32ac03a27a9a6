"""What each step of a pushing request writes (the connector's scheduler side, on plain
scheduler outputs), how the reader commits the pushed blocks and copies a partial last one
into its request (a fake block pool), and how the per-layer timings read (no engine)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv (make install-vllm)")

from connector.vllm.connector_scheduler import SchedulerSide  # noqa: E402
from connector.vllm.kv_wire import (  # noqa: E402
    AllocOrder,
    CommitOrder,
    LayerWritten,
    Pinned,
    PushOrder,
    TailCopy,
    TailOrder,
    TransferOrder,
    control_params,
    order_params,
)
from connector.vllm.push import overlapped_layers  # noqa: E402

BLOCK = 128


class NoReports:
    def send(self, report) -> None:
        raise AssertionError(f"unexpected report {report!r}")


def pushing(prompt_tokens: int, targets: int) -> tuple[SchedulerSide, SimpleNamespace]:
    side = SchedulerSide(block_size=BLOCK, reports=NoReports())  # type: ignore[arg-type]
    order = TransferOrder(transfer_id="t1", push=PushOrder(agent_name="reader", agent_metadata=b"m",
                                                           block_ids=list(range(100, 100 + targets))))
    request = SimpleNamespace(request_id="r1", kv_transfer_params=order_params(order),
                              num_prompt_tokens=prompt_tokens)
    side.on_new_request(request)  # type: ignore[arg-type]
    return side, request


def new_step(computed: int, scheduled: int, block_ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        num_scheduled_tokens={"r1": scheduled},
        scheduled_new_reqs=[SimpleNamespace(req_id="r1", block_ids=(block_ids,), num_computed_tokens=computed)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                              num_computed_tokens=[]))


def cached_step(computed: int, scheduled: int, new_block_ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        num_scheduled_tokens={"r1": scheduled}, scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["r1"], resumed_req_ids=set(),
                                              new_block_ids=[(new_block_ids,)], num_computed_tokens=[computed]))


def test_each_chunk_writes_the_blocks_it_completes_and_the_last_asks_for_the_outcome() -> None:
    side, _ = pushing(700, 5)
    [first] = side.take_pushes(new_step(0, 512, [10, 11, 12, 13]))  # type: ignore[arg-type]
    assert (first.indices, first.local_block_ids, first.final) == ([0, 1, 2, 3], [10, 11, 12, 13], False)
    assert first.target_block_ids == [100, 101, 102, 103, 104] and first.agent_name == "reader"
    [last] = side.take_pushes(cached_step(512, 188, [14, 15]))  # type: ignore[arg-type]
    assert (last.indices, last.local_block_ids, last.final, last.whole_indices) == ([4], [14], True, [])
    assert side.take_pushes(cached_step(700, 1, [])) == []  # decoding: nothing more to push


def test_a_chunk_ending_inside_a_block_writes_it_with_the_next_chunk() -> None:
    side, _ = pushing(400, 3)
    [first] = side.take_pushes(new_step(0, 200, [7, 8]))  # type: ignore[arg-type]
    assert (first.indices, first.final) == ([0], False)
    [last] = side.take_pushes(cached_step(200, 200, [9, 6]))  # type: ignore[arg-type]
    assert (last.indices, last.local_block_ids, last.final) == ([1, 2], [8, 9], True)


def test_blocks_reused_from_the_prefix_cache_are_written_whole_at_the_end() -> None:
    side, _ = pushing(600, 4)
    [only] = side.take_pushes(new_step(256, 344, [20, 21, 22, 23, 24]))  # type: ignore[arg-type]
    assert (only.indices, only.local_block_ids) == ([2, 3], [22, 23])
    assert (only.whole_indices, only.whole_local_block_ids, only.final) == ([0, 1], [20, 21], True)


def test_fewer_targets_than_blocks_and_a_prompt_without_a_full_block() -> None:
    side, _ = pushing(600, 2)  # the reader could spare only two blocks
    [only] = side.take_pushes(new_step(0, 600, [1, 2, 3, 4, 5]))  # type: ignore[arg-type]
    assert (only.indices, only.final) == ([0, 1], True)
    side, _ = pushing(60, 0)
    [only] = side.take_pushes(new_step(0, 60, [1]))  # type: ignore[arg-type]
    assert (only.indices, only.whole_indices, only.final) == ([], [], True)  # still one outcome


def test_a_targeted_partial_last_block_is_written_whole_at_the_last_step() -> None:
    side, _ = pushing(700, 6)  # 5 full blocks and 60 tokens: the reader took a block for them
    [first] = side.take_pushes(new_step(0, 512, [10, 11, 12, 13]))  # type: ignore[arg-type]
    assert (first.indices, first.final) == ([0, 1, 2, 3], False)  # the tail is not final yet
    [last] = side.take_pushes(cached_step(512, 188, [14, 15]))  # type: ignore[arg-type]
    assert (last.indices, last.local_block_ids, last.final) == ([4, 5], [14, 15], True)


class Pool:
    """vLLM's block pool, as the reader's commit uses it."""

    def __init__(self) -> None:
        self.free = list(range(10, 20))
        self.num_gpu_blocks = len(self.free)
        self.cached: list[int] = []

    def get_num_free_blocks(self) -> int:
        return len(self.free)

    def get_new_blocks(self, count: int) -> list[SimpleNamespace]:
        taken, self.free = self.free[:count], self.free[count:]
        return [SimpleNamespace(block_id=block_id) for block_id in taken]

    def cache_full_blocks(self, request, blocks, start: int, count: int, block_size: int, group: int) -> None:
        self.cached += [block.block_id for block in blocks]

    def free_blocks(self, blocks) -> None:
        self.free += [block.block_id for block in blocks]


class Reports:
    def __init__(self) -> None:
        self.sent: list[Pinned] = []

    def send(self, report: Pinned) -> None:
        self.sent.append(report)


def committed(verified_full: int, keep_next: bool) -> tuple[list[int], Pool]:
    """A reader of a 700-token prompt (5 full blocks and a partial one) commits
    `verified_full` full blocks: what its commit answers, and the pool after."""
    pool, reports = Pool(), Reports()
    side = SchedulerSide(block_size=BLOCK, reports=reports)  # type: ignore[arg-type]
    side.bind_block_pool(pool)  # type: ignore[arg-type]
    side.on_new_request(SimpleNamespace(request_id="c1", block_hashes=[],  # type: ignore[arg-type]
                                        kv_transfer_params=control_params(AllocOrder(key="k", count=6))))
    side.on_new_request(SimpleNamespace(request_id="c2", block_hashes=[b"h"] * 5,  # type: ignore[arg-type]
                                        kv_transfer_params=control_params(CommitOrder(key="k", count=verified_full,
                                                                                      keep_next=keep_next))))
    allocated, answer = reports.sent
    assert allocated.block_ids == [10, 11, 12, 13, 14, 15]
    return answer.block_ids, pool


def test_the_commit_keeps_the_partial_block_pinned_uncached_only_right_after_every_full_one() -> None:
    answer, pool = committed(5, keep_next=True)
    assert answer == [10, 11, 12, 13, 14, 15] and pool.cached == [10, 11, 12, 13, 14]  # 15: pinned, not cached
    assert 15 not in pool.free
    answer, pool = committed(4, keep_next=True)  # a full block failed: the tail is not kept either
    assert answer == [10, 11, 12, 13] and 14 in pool.free and 15 in pool.free
    answer, pool = committed(5, keep_next=False)
    assert answer == [10, 11, 12, 13, 14] and 15 in pool.free


def test_a_pushed_partial_block_is_offered_after_the_full_blocks_once_and_copied_into_the_request() -> None:
    side = SchedulerSide(block_size=BLOCK, reports=NoReports())  # type: ignore[arg-type]
    order = TransferOrder(transfer_id="t1", release_key="k", tail=TailOrder(block_id=15, tokens=60))
    # the decode worker's request: the 700-token prompt and the pushed first token
    request = SimpleNamespace(request_id="r1", kv_transfer_params=order_params(order), num_prompt_tokens=701,
                              num_tokens=701, block_hashes=[], prefill_stats=None)
    side.on_new_request(request)  # type: ignore[arg-type]
    assert side.matched_tokens(request, 512) == 0  # not every full block cached: computed instead
    assert side.matched_tokens(request, 640) == 60  # the tail, leaving the first token to compute
    blocks = SimpleNamespace(get_block_ids=lambda: ([30, 31, 32, 33, 34, 35],))
    side.after_alloc(request, blocks, 60)  # type: ignore[arg-type]
    assert side.take_tail_copies() == [TailCopy(request_id="r1", source=15, target=35)]
    assert side.take_tail_copies() == []
    assert side.matched_tokens(request, 640) == 0  # preempted and back: its source is no longer pinned
    side.after_alloc(request, blocks, 0)  # type: ignore[arg-type]
    assert side.take_tail_copies() == []


def test_overlap_means_a_write_started_before_the_next_layer_was_computed() -> None:
    def write(layer: int, computed: float, started: float) -> LayerWritten:
        return LayerWritten(layer=layer, blocks=4, computed_s=computed, started_s=started, done_s=started + 0.001,
                            ok=True)

    writes = [write(0, 0.010, 0.011), write(1, 0.030, 0.031), write(2, 0.050, 0.060),  # layer 1 overlapped 2
              write(0, 0.100, 0.120), write(1, 0.110, 0.112)]  # a second chunk: layer 0's write began late
    assert overlapped_layers(writes) == [0, 1]
    assert overlapped_layers([write(-1, 0.0, 0.001)]) == []  # whole blocks are not layers
